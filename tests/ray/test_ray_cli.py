"""The Ray options of `pipeshard up` / `fleet`: parsed without Ray, and without Ray installed
`--ray` says how to install it while a plain `up` is unchanged."""

from __future__ import annotations

import importlib.util

import pytest

from pipeshard.cli import build_parser


def test_up_parses_the_ray_options_and_a_plain_up_keeps_its_defaults():
    parser = build_parser()
    args = parser.parse_args(["up", "--ray", "--replicas", "auto", "--no-profile"])
    assert (args.ray, args.replicas, args.no_profile, args.stages) == ("auto", "auto", True, None)
    args = parser.parse_args(["up", "--ray", "10.0.0.1:6379", "--stages", "3", "--secure"])
    assert (args.ray, args.stages, args.secure) == ("10.0.0.1:6379", 3, True)
    plain = parser.parse_args(["up"])
    assert (plain.ray, plain.replicas) == (None, 1)
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--replicas", "0"])
    assert parser.parse_args(["fleet", "plan", "--ray", "--stages", "2"]).stages == 2
    assert parser.parse_args(["fleet", "drain", "abcd1234", "--ray"]).ray == "auto"


def test_ray_options_without_ray_say_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    parser = build_parser()
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[ray\]'"):
        parser.parse_args(["up", "--ray"]).func(parser.parse_args(["up", "--ray"]))
    # --replicas auto is a Ray fleet's: refused by name without --ray, before anything starts
    args = parser.parse_args(["up", "--replicas", "auto"])
    assert args.func(args) == 2
    assert "--replicas auto needs --ray" in capsys.readouterr().err
