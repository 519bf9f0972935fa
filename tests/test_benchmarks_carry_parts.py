"""scripts/carry_parts.sh: a file split into parts (one folder per device call), received part
by part and joined with its sha256 checked; a missing or damaged part is refused."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "carry_parts.sh"


def _run(*args: str, store: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "CARRY_STORE": str(store)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=check
    )


@pytest.fixture
def split(tmp_path):
    """A 2.5 MiB file split into 1 MiB parts under tmp/parts/blob (c1..c3)."""
    data = os.urandom(5 * 2**19)
    file = tmp_path / "model.bin"
    file.write_bytes(data)
    _run("split", str(file), str(tmp_path / "parts" / "blob"), "1", store=tmp_path / "store")
    return tmp_path, data


def test_split_writes_one_part_per_folder_and_the_checksum_last(split):
    tmp_path, data = split
    parts = tmp_path / "parts" / "blob"
    assert sorted(p.name for p in parts.iterdir()) == ["c1", "c2", "c3"]
    sizes = [sum(f.stat().st_size for f in (parts / c).glob("*.part.*")) for c in ("c1", "c2")]
    assert sizes == [2**20, 2**20]
    assert sorted(f.name for f in (parts / "c3").iterdir()) == [
        "model.bin.part.02",
        "model.bin.sha256",
    ]
    digest = (parts / "c3" / "model.bin.sha256").read_text().split()[0]
    assert digest == hashlib.sha256(data).hexdigest()


def test_parts_received_in_calls_join_to_the_same_bytes(split):
    tmp_path, data = split
    store, parts = tmp_path / "store", tmp_path / "parts" / "blob"
    _run("recv", str(parts / "c1"), store=store)
    _run("recv", str(parts / "c2"), store=store)
    joined = Path(_run("join", str(parts / "c3"), store=store).stdout.strip())
    assert joined == store / "blob" / "model.bin" and joined.read_bytes() == data
    # a later join finds it whole; DEST puts a copy elsewhere
    again = _run("join", str(parts / "c3"), str(tmp_path / "out" / "m.bin"), store=store)
    assert (tmp_path / "out" / "m.bin").read_bytes() == data and again.returncode == 0


def test_a_missing_or_damaged_part_is_refused(split):
    tmp_path, _ = split
    store, parts = tmp_path / "store", tmp_path / "parts" / "blob"
    _run("recv", str(parts / "c1"), store=store)  # c2 missed (the machine went cold)
    missed = _run("join", str(parts / "c3"), store=store, check=False)
    assert missed.returncode != 0 and "checksum mismatch" in missed.stderr
    assert not (store / "blob" / "model.bin").exists()
    _run("recv", str(parts / "c2"), store=store)
    (store / "blob" / "model.bin.part.01").write_bytes(b"x" * 2**20)  # damaged in transit
    damaged = _run("join", str(parts / "c3"), store=store, check=False)
    assert damaged.returncode != 0 and not (store / "blob" / "model.bin").exists()


def test_split_refuses_bad_input_and_touches_nothing(tmp_path):
    store = tmp_path / "store"
    absent = _run("split", str(tmp_path / "nope"), str(tmp_path / "p"), store=store, check=False)
    assert absent.returncode == 2 and "no file" in absent.stderr
    file = tmp_path / "f.bin"
    file.write_bytes(b"abc")
    size = _run("split", str(file), str(tmp_path / "p"), "0", store=store, check=False)
    assert size.returncode == 2 and "positive" in size.stderr
    assert not (tmp_path / "p").exists()
    (tmp_path / "p").mkdir()
    exists = _run("split", str(file), str(tmp_path / "p"), store=store, check=False)
    assert exists.returncode == 2 and "exists" in exists.stderr and not any(store.glob("*"))
