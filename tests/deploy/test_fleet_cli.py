"""deploy/fleet.py's arguments and core assignment (the fleet itself runs in test_router.py)."""

from __future__ import annotations

import os

import pytest

from spyre_serve.deploy.fleet import cores_of, parse_args


def test_arguments_after_the_separator_go_to_every_replica():
    args, serve = parse_args(["--replicas", "3", "--port", "9000", "--", "--model", "granite-tiny"])
    assert (args.replicas, args.port, serve) == (3, 9000, ["--model", "granite-tiny"])


@pytest.mark.parametrize("argv", [["--replicas", "0"], ["--", "--port", "1"], ["--", "--host=0.0.0.0"]])
def test_what_the_fleet_chooses_itself_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


def test_each_replica_gets_its_own_cores_in_turn_wrapping_round():
    mine = sorted(os.sched_getaffinity(0))
    assert cores_of(0, 0) is None
    assert cores_of(0, 1) == [mine[0]]
    assert cores_of(len(mine), 1) == [mine[0]]             # more replicas than cores: round again
    assert cores_of(1, 1) == [mine[1 % len(mine)]]
