"""An independent decoder of PageKV's KV events, written from the schema in
docs/KV_EVENTS.md (vLLM's current wire format) and sharing no code with the
C++ publisher. It is strict: a missing or unknown field, a wrong type, a
string that is not UTF-8 or a token count that does not match the blocks is
an error, so a test using it fails on any drift from the documented layout.

A message is three frames: topic, sequence (8 bytes, big-endian), payload.
The payload is a msgpack array [ts: float, events: list, data_parallel_rank:
int | None]; each event a map tagged by "type".
"""
import msgpack

MEDIUMS = {"GPU", "CPU", "DISK", "REDIS"}

STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
REMOVED_FIELDS = {"type", "block_hashes", "medium", "group_idx"}


class DecodeError(ValueError):
    pass


def _check(cond, what):
    if not cond:
        raise DecodeError(what)


def _hash(h, as_bytes):
    if as_bytes:
        _check(isinstance(h, bytes) and len(h) in (16, 32), f"block hash {h!r} is not 16 or 32 bytes")
    else:
        _check(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64, f"block hash {h!r} is not a u64")
    return h


def _stored(e, as_bytes):
    _check(set(e) - {"kv_cache_spec_sliding_window"} == STORED_FIELDS,
           f"BlockStored fields {sorted(e)} != {sorted(STORED_FIELDS)}")
    hashes = e["block_hashes"]
    _check(isinstance(hashes, list) and hashes, "block_hashes is not a non-empty list")
    for h in hashes:
        _hash(h, as_bytes)
    _check(len(set(hashes)) == len(hashes), "a block hash repeats within one event")
    if e["parent_block_hash"] is not None:
        _hash(e["parent_block_hash"], as_bytes)
        _check(e["parent_block_hash"] not in hashes, "a block is its own parent")
    bs = e["block_size"]
    _check(isinstance(bs, int) and bs > 0, f"block_size {bs!r}")
    toks = e["token_ids"]
    _check(isinstance(toks, list) and all(isinstance(t, int) and t >= 0 for t in toks), "token_ids are not ids")
    _check(len(toks) == bs * len(hashes), f"{len(toks)} token ids for {len(hashes)} blocks of {bs}")
    _check(e["lora_id"] is None or isinstance(e["lora_id"], int), "lora_id")
    _check(e["lora_name"] is None or isinstance(e["lora_name"], str), "lora_name")
    _check(e["medium"] in MEDIUMS, f"medium {e['medium']!r}")
    extra = e["extra_keys"]
    _check(isinstance(extra, list) and len(extra) == len(hashes), "extra_keys is not one entry per block")
    for x in extra:
        _check(x is None or (isinstance(x, list) and all(isinstance(k, str) for k in x)), f"extra keys {x!r}")
    _check(isinstance(e["group_idx"], int), "group_idx")
    _check(isinstance(e["kv_cache_spec_kind"], str), "kv_cache_spec_kind")
    if e["kv_cache_spec_kind"] == "sliding_window":  # a hybrid cache's sliding group
        _check(isinstance(e.get("kv_cache_spec_sliding_window"), int) and e["kv_cache_spec_sliding_window"] > 0,
               "kv_cache_spec_sliding_window")
    return e


def _removed(e, as_bytes):
    _check(set(e) == REMOVED_FIELDS, f"BlockRemoved fields {sorted(e)} != {sorted(REMOVED_FIELDS)}")
    _check(isinstance(e["block_hashes"], list) and e["block_hashes"], "block_hashes is not a non-empty list")
    for h in e["block_hashes"]:
        _hash(h, as_bytes)
    _check(e["medium"] in MEDIUMS, f"medium {e['medium']!r}")
    _check(isinstance(e["group_idx"], int), "group_idx")
    return e


def decode_payload(payload, as_bytes=False):
    """(ts, events, data_parallel_rank) of one batch payload."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, UnicodeDecodeError) as e:
        raise DecodeError(f"not msgpack: {e}") from e
    _check(isinstance(batch, list) and len(batch) == 3, "a batch is not [ts, events, data_parallel_rank]")
    ts, events, rank = batch
    _check(isinstance(ts, float), "ts is not a float")
    _check(isinstance(events, list), "events is not a list")
    _check(rank is None or isinstance(rank, int), "data_parallel_rank")
    out = []
    for e in events:
        _check(isinstance(e, dict) and isinstance(e.get("type"), str), "an event is not a map tagged by type")
        if e["type"] == "BlockStored":
            out.append(_stored(e, as_bytes))
        elif e["type"] == "BlockRemoved":
            out.append(_removed(e, as_bytes))
        elif e["type"] == "AllBlocksCleared":
            _check(set(e) == {"type"}, f"AllBlocksCleared fields {sorted(e)}")
            out.append(e)
        else:
            raise DecodeError(f"unknown event type {e['type']!r}")
    return ts, out, rank


def decode_message(frames, as_bytes=False):
    """(topic, sequence, ts, events, rank) of one multipart message."""
    _check(len(frames) == 3, f"{len(frames)} frames, not 3")
    topic, seq, payload = frames
    _check(len(seq) == 8, "the sequence frame is not 8 bytes")
    return (topic.decode("utf-8"), int.from_bytes(seq, "big"), *decode_payload(payload, as_bytes))


class Index:
    """What a router keeps: the block hashes each medium holds, built from
    the events alone; inconsistencies (a removal of a block never stored,
    a parent never seen) are collected in `errors`."""

    def __init__(self):
        self.held = {m: set() for m in MEDIUMS}
        self.ever = set()
        self.errors = []
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply(self, event):
        self.counts[event["type"]] += 1
        if event["type"] == "BlockStored":
            parent = event["parent_block_hash"]
            if parent is not None and parent not in self.ever:
                self.errors.append(f"parent {parent} was never stored")
            self.held[event["medium"]].update(event["block_hashes"])
            self.ever.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            for h in event["block_hashes"]:
                if h not in self.held[event["medium"]]:
                    self.errors.append(f"removed {h} from {event['medium']} which does not hold it")
                self.held[event["medium"]].discard(h)
        else:
            self.held["GPU"].clear()
