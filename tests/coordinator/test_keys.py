"""The key file of ``pipeshard keys``: add, list, revoke, reloading, and refusals naming the problem."""

from __future__ import annotations

import json
import os

import pytest

from pipeshard.cli import main as pipeshard
from pipeshard.errors import InvalidArgument, NotFound
from pipeshard.keys import KeyRing, add_key, digest, read_entries, revoke_key


def test_add_prints_the_key_last_and_stores_only_its_hash(tmp_path, capsys):
    path = tmp_path / "certs" / "api-keys"
    argv = ["keys", "--keys-file", str(path), "add", "alice", "--weight", "2", "--max-running", "4"]
    assert pipeshard(argv) == 0
    key = capsys.readouterr().out.splitlines()[-1]
    assert len(key) > 40 and key not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    (entry,) = read_entries(path)
    assert (entry.name, entry.sha256, entry.weight, entry.max_running, entry.max_queued) == (
        "alice",
        digest(key),
        2.0,
        4,
        None,
    )


def test_list_shows_settings_but_no_key_or_hash(tmp_path, capsys):
    path = tmp_path / "api-keys"
    key = add_key(path, "alice", max_queued=7)
    assert pipeshard(["keys", "--keys-file", str(path), "list"]) == 0
    out = capsys.readouterr().out
    assert "alice" in out and " 7 " in out
    secret = digest(key)
    assert not any(secret[i : i + 6] in out for i in range(len(secret) - 6)) and key[4:10] not in out


def test_the_environment_moves_the_key_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPESHARD_API_KEYS", str(tmp_path / "elsewhere"))
    assert pipeshard(["keys", "add", "svc"]) == 0
    assert [e.name for e in read_entries(tmp_path / "elsewhere")] == ["svc"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "alice"}, "already exists"),
        ({"name": "bad name"}, "`name`"),
        ({"name": "bob", "weight": 0.0}, "`weight`"),
        ({"name": "bob", "weight": float("nan")}, "`weight`"),
        ({"name": "bob", "max_running": -1}, "`max_running`"),
    ],
)
def test_bad_additions_are_refused_by_name(tmp_path, kwargs, message):
    path = tmp_path / "api-keys"
    add_key(path, "alice")
    before = path.read_text()
    with pytest.raises(InvalidArgument, match=message):
        add_key(path, **kwargs)
    assert path.read_text() == before


def test_cli_errors_exit_2_with_the_reason(tmp_path, capsys):
    path = str(tmp_path / "api-keys")
    assert pipeshard(["keys", "--keys-file", path, "revoke", "nobody"]) == 2
    assert "no key named 'nobody'" in capsys.readouterr().err
    assert pipeshard(["keys", "--keys-file", path, "add", "a", "--weight", "-1"]) == 2
    assert "`weight`" in capsys.readouterr().err


def test_revoke_removes_one_key_and_a_ring_sees_changes_on_disk(tmp_path):
    path = tmp_path / "api-keys"
    alice, bob = add_key(path, "alice"), add_key(path, "bob")
    ring = KeyRing(path, recheck_s=0.0)
    assert ring.lookup(alice).name == "alice" and ring.lookup(bob).name == "bob"
    assert ring.lookup("psk-invented") is None
    revoke_key(path, "alice")
    assert ring.lookup(alice) is None and ring.lookup(bob).name == "bob"
    with pytest.raises(NotFound, match="alice"):
        revoke_key(path, "alice")
    carol = add_key(path, "carol")
    assert ring.lookup(carol).name == "carol"
    assert set(os.listdir(tmp_path)) == {"api-keys", ".api-keys.lock"}  # no temporary files left


def test_concurrent_additions_all_land(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "api-keys"
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda i: add_key(path, f"user{i}"), range(16)))
    ring = KeyRing(path, recheck_s=0.0)
    assert sorted(ring.lookup(key).name for key in keys) == sorted(f"user{i}" for i in range(16))


def test_a_broken_key_file_keeps_the_last_good_keys(tmp_path):
    path = tmp_path / "api-keys"
    alice = add_key(path, "alice")
    ring = KeyRing(path, recheck_s=0.0)
    assert ring.lookup(alice) is not None
    path.write_text("{not json")
    assert ring.lookup(alice) is not None
    with pytest.raises(InvalidArgument, match="not a pipeshard key file"):
        read_entries(path)
    path.write_text(json.dumps({"keys": []}))
    assert ring.lookup(alice) is None
