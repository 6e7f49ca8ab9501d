"""The bench's table of peers (:data:`specdec.bench.methods.PEERS`): every row parses as a method
that says what the row says, and the rows agree with each other and with the drafter registry."""

from __future__ import annotations

import pytest

from specdec.bench.methods import PEERS, MethodSpec, method_of_record, parse_method
from specdec.bench.servers import LLAMA_SERVER_FLAGS
from specdec.drafters import registry as drafters


@pytest.mark.parametrize("name", list(PEERS))
def test_every_peer_parses_as_the_method_its_row_describes(name):
    peer = PEERS[name]
    method = parse_method(name)
    assert method == MethodSpec(name) and method.name == name and method.is_peer
    assert parse_method(method.name) == method == method_of_record(method.record())
    assert method.backend == peer.backend and parse_method(name, default_backend="gguf").backend == peer.backend
    assert method.is_server == peer.is_server
    assert method.needs_draft_model == peer.uses_draft_model
    assert method.peer is None  # a peer is measured against no other peer
    if "k" in peer.keys:
        assert parse_method(f"{name}:k=3") == MethodSpec(name, k=3)
    else:
        with pytest.raises(ValueError, match="unknown key 'k'"):
            parse_method(f"{name}:k=3")


@pytest.mark.parametrize("name", list(PEERS))
def test_a_row_is_consistent(name):
    peer = PEERS[name]
    assert peer.name == name and peer.description
    assert peer.tool in ("transformers", "llama-cpp-python", "llama-server")
    assert set(peer.keys) <= {"k"}
    assert peer.default_k is None or ("k" in peer.keys and peer.default_k > 0)
    for drafter in (peer.drafter, peer.peer_of):
        assert drafter is None or drafter in drafters.names()
    # The "vs peer" column compares a project drafter with a peer that drafts the same way, on torch.
    assert peer.peer_of is None or (peer.peer_of == peer.drafter and peer.tool == "transformers")
    if peer.is_server:
        assert ("{draft}" in peer.server_flags) == peer.uses_draft_model
    else:
        assert peer.server_flags == ()


def test_each_project_drafter_has_at_most_one_peer_and_finds_it():
    peer_of = [p.peer_of for p in PEERS.values() if p.peer_of is not None]
    assert len(peer_of) == len(set(peer_of)) and peer_of
    for peer in PEERS.values():
        if peer.peer_of is not None:
            assert parse_method(f"spec:{peer.peer_of}:block").peer == peer.name
            assert parse_method(f"spec:{peer.peer_of}:block:backend=llamacpp").peer is None


def test_the_server_flags_and_the_unknown_method_message_come_from_the_table():
    assert LLAMA_SERVER_FLAGS == {p.name: p.server_flags for p in PEERS.values() if p.is_server}
    assert list(LLAMA_SERVER_FLAGS) == ["llama-server", "llama-server-md", "llama-server-spec-default",
                                       "llama-server-ngram"]
    with pytest.raises(ValueError, match="or a peer: " + ", ".join(PEERS)):
        parse_method("hf-unknown")
