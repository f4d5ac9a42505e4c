"""contract/refs.py: engine references, tag records and store keys, as data."""

from __future__ import annotations

import pytest

from contract.refs import EngineRef, TagRecord, engine_key, parse_ref, split_s3, tag_key

EID = "0123456789abcdef"


def test_parse_tag_and_id_references() -> None:
    r = parse_ref("s3://bucket/some/prefix/tiny-chat@prod")
    assert (r.store, r.model, r.tag, r.engine_id, r.remote) == (
        "s3://bucket/some/prefix", "tiny-chat", "prod", None, True)
    r = parse_ref(f"/srv/engines/tiny-chat/{EID}/")
    assert (r.store, r.model, r.tag, r.engine_id, r.remote) == (
        "/srv/engines", "tiny-chat", None, EID, False)
    assert str(r) == f"/srv/engines/tiny-chat/{EID}"
    assert str(parse_ref("s3://b/m@t").pinned(EID)) == f"s3://b/m/{EID}"
    assert split_s3("s3://bucket/a/b/") == ("bucket", "a/b")
    assert engine_key("m", EID, "rank0.safetensors") == f"m/{EID}/rank0.safetensors"
    assert tag_key("m", "prod") == "m/tags/prod"


@pytest.mark.parametrize("text, why", [
    ("s3://bucket/model", "not STORE/MODEL@TAG"),  # neither a tag nor an id
    ("s3://bucket/model/xyz", "engine id is 16 hex digits"),
    ("s3:///model@prod", "names no bucket"),
    ("s3://b/tags@prod", "not a valid name"),  # the tags directory is not a model
    ("s3://b/m@bad/tag", "not STORE/MODEL@TAG"),
    ("s3://b/m@", "not a valid name"),
])
def test_bad_references_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ref(text)


def test_tag_record_round_trip_and_validation() -> None:
    rec = TagRecord("m", "prod", EID, "a" * 64, "2026-01-01T00:00:00+00:00")
    assert TagRecord.from_bytes(rec.to_bytes()) == rec
    with pytest.raises(ValueError, match="not JSON"):
        TagRecord.from_bytes(b"{")
    with pytest.raises(ValueError, match="not an engine id"):
        TagRecord.from_bytes(rec.to_bytes().replace(EID.encode(), b"zz"))
    with pytest.raises(ValueError, match="tag or an engine id"):
        EngineRef("s3://b", "m", tag="t", engine_id=EID)
