"""The training application. The loop is at the top (`train`, `runtime`, `optim`, `ema`, `metrics`, `moe_metrics`,
`straggler`, `profiling`, `memory_snapshot`, `schedules`, `batch_ramp`, `zb_measure`, `atomic`); each other concern has one room: `config`, `data`,
`preflight` (can this run start), `launch`, `checkpoint`, `generate`.
"""
