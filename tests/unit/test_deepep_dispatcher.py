"""When `parallel.dispatcher: deepep` can run (the optional deep_ep package, a GPU, DeepEP's nodes of 8
GPUs) and the one-line start-up refusal otherwise. The wiring over a DeepEP-shaped buffer runs in
tests/distributed/test_buffers.py; the real package needs GPUs and NVSHMEM and has not run here."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from moe_train.config import ConfigError, load_config
from moe_train.preflight.start_up import choose_dispatcher
from parallel.dispatch import deepep as deepep_module
from parallel.dispatch.deepep import deepep_unavailable
from tests.unit.test_native_internode_dispatch import start_up_error

TINY = "moe_train/configs/tiny.yaml"


@pytest.fixture
def installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(deepep_module.importlib.util, "find_spec",
                        lambda name, *a: SimpleNamespace() if name == "deep_ep" else real(name, *a))


def test_without_the_package_it_names_the_install(monkeypatch):
    monkeypatch.setattr(deepep_module.importlib.util, "find_spec", lambda name, *a: None)
    problem = deepep_unavailable("cuda", 8, 8)
    assert "deep_ep package is not installed" in problem and "github.com/deepseek-ai/DeepEP" in problem


@pytest.mark.parametrize("device, ep, per_node, ok", [
    ("cuda", 8, 8, True), ("cuda", 4, 4, True), ("cuda", 16, 8, True), ("cuda", 160, 8, True),
    ("cuda", 168, 8, False), ("cuda", 8, 4, False), ("cuda", 16, 16, False), ("cpu", 8, 8, False),
])
def test_deepeps_node_layout_and_device(installed, device, ep, per_node, ok):
    problem = deepep_unavailable(device, ep, per_node)
    assert (problem is None) == ok, problem


def test_start_up_refuses_deepep_in_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(deepep_module.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError) as err:
        choose_dispatcher(load_config(TINY, ["parallel.dispatcher=deepep"]), None)
    (key, message), = err.value.problems
    assert key == "parallel.dispatcher" and "deep_ep package is not installed" in message and "'native'" in message
    err_text = start_up_error("deepep", monkeypatch, tmp_path, capsys)
    assert err_text.startswith("error: parallel.dispatcher: 'deepep' cannot run here")
