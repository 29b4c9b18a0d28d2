"""How a rank starts: forked from the pre-imported launcher (the default with gloo) or a fresh interpreter
(``TOOLKIT_RANK_START=exec``, and always with nccl). Both must compute the same bits and report a failure the
same way; the fault cases of tests/test_faults.py run forked, the report of fresh ranks is checked here."""
from __future__ import annotations

import pytest

from toolkit import LaunchError, launch
from toolkit.runtime.launch import START_ENV, forks_ranks


def test_forked_and_fresh_ranks_compute_the_same_bits(tmp_path, monkeypatch):
    forked = launch("toolkit.lessons.selftest:ddp_steps", 2, {}, threads=2, progress="none", out_dir=tmp_path / "f")
    monkeypatch.setenv(START_ENV, "exec")
    fresh = launch("toolkit.lessons.selftest:ddp_steps", 2, {}, threads=2, progress="none", out_dir=tmp_path / "e")
    assert [r["forked"] for r in forked] == [True, True] and [r["forked"] for r in fresh] == [False, False]
    assert [r["threads"] for r in forked] == [r["threads"] for r in fresh] == [2, 2]
    assert forked[0]["bits"] == forked[1]["bits"]  # DDP keeps the replicas equal
    assert [r["bits"] for r in forked] == [r["bits"] for r in fresh]


def test_fresh_ranks_name_a_killed_rank_from_torchruns_report(tmp_path, monkeypatch):
    monkeypatch.setenv(START_ENV, "exec")
    with pytest.raises(LaunchError) as info:
        launch("fault_targets:killed", 2, {}, timeout_s=30, progress="none", out_dir=tmp_path / "out")
    assert info.value.rank == 1 and str(info.value).startswith("rank 1 of 2 was killed by SIGKILL (signal 9)")


def test_which_launches_fork(monkeypatch):
    assert forks_ranks("gloo", 2) and not forks_ranks("gloo", 1) and not forks_ranks("nccl", 2)
    assert not forks_ranks("gloo", 2, ["--num_machines", "2"])  # one node only: the local rank is the rank
    monkeypatch.setenv(START_ENV, "spawn")
    with pytest.raises(ValueError, match="TOOLKIT_RANK_START must be 'fork' or 'exec', got 'spawn'"):
        launch("toolkit.lessons.selftest", 2, {}, progress="none")
