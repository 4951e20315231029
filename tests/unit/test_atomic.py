"""moe_train.atomic: a published file holds its old content or its new one, never a part, and no
temporary file stays behind."""
from pathlib import Path

import pytest

from moe_train.atomic import publish_bytes, publish_written


@pytest.mark.parametrize("durable", [False, True], ids=["plain", "durable"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, durable: bool):
    path = tmp_path / "record.json"
    path.write_text("old")

    def write_half_then_fail(tmp: Path) -> None:
        tmp.write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_written(path, write_half_then_fail, durable=durable)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


@pytest.mark.parametrize("durable", [False, True], ids=["plain", "durable"])
def test_a_written_file_replaces_the_old_one(tmp_path: Path, durable: bool):
    path = tmp_path / "record.json"
    path.write_text("old")
    publish_bytes(path, b"new", durable=durable)
    publish_written(tmp_path / "trace.json", lambda tmp: tmp.write_text("trace"), durable=durable)
    assert path.read_bytes() == b"new" and (tmp_path / "trace.json").read_text() == "trace"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json", "trace.json"]
