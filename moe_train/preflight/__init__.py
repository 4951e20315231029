"""Whether a run can start, decided before it starts: the config against the process layout, the
batch split and the pipeline schedule (`layout`, `pipeline`), this machine (device, dispatcher,
inputs, memory: `start_up`, `memory_limits`), and the cluster planner (`plan`, `plan_stages`,
`plan_traffic`; `python -m moe_train.plan`). The trainer, the launcher (`launch_info`) and
generation call it; nothing else refuses a run.
"""
