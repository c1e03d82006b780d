"""KV events from a real `pagekv serve`, read by a ZeroMQ SUB socket and the
independent decoder (kv_events_decoder.py): blocks stored by requests,
removed when a small pool evicts them, cleared by /reset_prefix_cache;
missed batches fetched again from the replay socket."""
import json
import random
import socket

import pytest
import zmq

from kv_events_decoder import DecodeError, Index, decode_message, decode_payload
from pagekv_server import MODEL_ID, Server

WORDS = ("the cat dog sun tree little big happy sad ran jumped saw Lily Ben ball park mom said play "
         "red blue bird fish home day night friend toy car").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receive_all(sub, first_timeout_ms=5000, quiet_ms=700):
    frames = []
    timeout = first_timeout_ms
    while sub.poll(timeout):
        frames.append(sub.recv_multipart())
        timeout = quiet_ms
    return frames


def prompt(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def events_server():
    pub_port, replay_port = free_port(), free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")

    def subscribe(proc):  # the server waits for this before it listens
        sub.connect(f"tcp://127.0.0.1:{pub_port}")

    s = Server("--blocks", "12", "--block-len", "16", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
               "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--kv-events-wait-ms", "20000",
               before_listening=subscribe)
    yield s, sub, ctx, replay_port
    s.stop()
    sub.close(linger=0)
    ctx.term()


def test_every_event_of_a_serving_run_decodes_with_vllms_layout(events_server):
    server, sub, ctx, replay_port = events_server
    rng = random.Random(7)
    client = server.client()
    shared = prompt(rng, 40)
    prompts = [shared + " " + prompt(rng, 12) for _ in range(3)] + [prompt(rng, 50) for _ in range(6)]
    for p in prompts:  # 12 blocks of 16 tokens: the later prompts evict the earlier ones' blocks
        client.completions.create(model=MODEL_ID, prompt=p, max_tokens=6, temperature=0)
    status, body = server.post("/reset_prefix_cache", "")
    assert (status, json.loads(body)) == (200, {"status": "ok"})

    frames = receive_all(sub)
    assert frames, "no KV events from the server"
    index = Index()
    expected_topic = f"kv@{socket.gethostname()}:{server.port}@{MODEL_ID}"
    payloads = {}
    for n, f in enumerate(frames):
        topic, seq, ts, events, rank = decode_message(f)
        assert topic == expected_topic
        assert seq == n, "batches arrive in order from 0"
        assert rank == 0 and ts > 1.7e9 and events
        payloads[seq] = f[2]
        for e in events:
            index.apply(e)
    assert not index.errors, index.errors[:5]
    assert index.counts["BlockStored"] >= len(prompts)
    assert index.counts["BlockRemoved"] > 0, "the small pool evicted cached blocks"
    assert index.counts["AllBlocksCleared"] == 1
    assert not index.held["GPU"], "nothing held after the reset"
    stored = [e for f in frames for e in decode_message(f)[3] if e["type"] == "BlockStored"]
    assert all(e["medium"] == "GPU" and e["block_size"] == 16 for e in stored)
    assert all(e["kv_cache_spec_kind"] == "full_attention" and e["group_idx"] == 0 for e in stored)
    firsts = [e for e in stored if e["parent_block_hash"] is None]
    assert firsts and all(x is None or all(not k.startswith("salt") for k in x) for e in firsts
                          for x in e["extra_keys"]), "no salt without --api-key or cache_salt"
    # The prompts after the first reuse its shared blocks and publish only
    # their own, chained to a block already announced.
    assert any(e["parent_block_hash"] is not None for e in stored)

    # Replay: every batch from sequence 2, byte for byte, then the end marker.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (2).to_bytes(8, "big")])
    replayed = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), payload))
    else:
        pytest.fail("no end marker from the replay socket")
    dealer.close(linger=0)
    assert [s for s, _ in replayed] == list(range(2, len(frames)))
    assert all(payloads[s] == p for s, p in replayed)
    decode_payload(replayed[-1][1])


def test_the_decoder_refuses_drift():
    import msgpack
    good = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 0])
    decode_payload(good)
    for bad in ([1.0, [{"type": "AllBlocksCleared"}]],                      # the old two-element batch
                [1.0, [["AllBlocksCleared"]], 0],                          # a tagged array
                [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "pool", "group_idx": 0}], 0],
                [1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 32], "medium": "GPU", "group_idx": 0}], 0]):
        with pytest.raises(DecodeError):
            decode_payload(msgpack.packb(bad))
