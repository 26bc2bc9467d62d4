"""Reading SFT records: formats, field mapping, default ids, and every bad-input error message."""
import json
import re

import pytest

from iprox_lightning.data.sources import (
    DataFormatError,
    read_records,
    resolve_field_map,
    source_name,
    write_records_jsonl,
)

DOLLY = [
    {"instruction": "Say hi.", "context": "", "response": "hi", "category": "greet"},
    {"instruction": "Add.", "context": "1+2", "response": "3", "category": "math"},
    {"instruction": "Name a color.", "response": "red"},  # no context, no category
]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_jsonl_defaults(tmp_path):
    p = _jsonl(tmp_path / "mydata.jsonl", DOLLY)
    recs = read_records(p)
    assert recs == [
        {"id": "mydata-000000", "category": "greet", "instruction": "Say hi.", "context": "", "response": "hi"},
        {"id": "mydata-000001", "category": "math", "instruction": "Add.", "context": "1+2", "response": "3"},
        {"id": "mydata-000002", "category": "mydata", "instruction": "Name a color.", "context": "", "response": "red"},
    ]


def test_blank_lines_and_explicit_ids(tmp_path):
    rows = [dict(DOLLY[0], id="a"), "", "   ", dict(DOLLY[1], id=7)]
    recs = read_records(_jsonl(tmp_path / "x.jsonl", rows))
    assert [r["id"] for r in recs] == ["a", "7"]


def test_json_parquet_and_directory_agree(tmp_path):
    (tmp_path / "d").mkdir()
    _jsonl(tmp_path / "d" / "a.jsonl", DOLLY[:2])
    (tmp_path / "d" / "b.json").write_text(json.dumps({"data": DOLLY[2:]}))
    recs = read_records(tmp_path / "d")
    assert [r["id"] for r in recs] == ["a-000000", "a-000001", "b-000000"]
    assert [r["category"] for r in recs] == ["greet", "math", "b"]

    (tmp_path / "list.json").write_text(json.dumps(DOLLY))
    pq_rows = [dict(r, context=r.get("context", ""), category=r.get("category")) for r in DOLLY]
    from_json = read_records(tmp_path / "list.json")
    from_pq = read_records(_parquet(tmp_path / "list.parquet", pq_rows))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("id", "category")} for r in rs]  # noqa: E731
    assert strip(from_json) == strip(from_pq) == strip(read_records(_jsonl(tmp_path / "list.jsonl", DOLLY)))
    assert [r["id"] for r in from_pq] == ["list-000000", "list-000001", "list-000002"]
    assert [r["category"] for r in from_pq] == ["greet", "math", "list"]  # None -> source name


def test_field_map_alpaca(tmp_path):
    rows = [{"instruction": "Add.", "input": "2+2", "output": "4", "uid": "q1", "type": "math"}]
    recs = read_records(_jsonl(tmp_path / "alpaca.jsonl", rows),
                        {"context": "input", "response": "output", "id": "uid", "category": "type"})
    assert recs == [{"id": "q1", "category": "math", "instruction": "Add.", "context": "2+2", "response": "4"}]
    with pytest.raises(ValueError, match=r"field_map: unknown field 'output'"):
        resolve_field_map({"output": "response"})


def test_chat_messages(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}]
    recs = read_records(_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs, "id": "c1"}]))
    assert recs == [{"id": "c1", "category": "chat", "messages": msgs}]


def test_hub_id(monkeypatch):
    import datasets

    import iprox_lightning.models.hub as hub

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: (True, "huggingface.co"))  # as if online
    calls = []

    def fake_load(name, split=None, **kw):
        calls.append((name, split))
        return datasets.Dataset.from_list([dict(DOLLY[0], context=""), dict(DOLLY[1])])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    recs = read_records("databricks/databricks-dolly-15k")
    assert calls == [("databricks/databricks-dolly-15k", "train")]
    assert [r["id"] for r in recs] == ["databricks-dolly-15k-000000", "databricks-dolly-15k-000001"]
    assert source_name("databricks/databricks-dolly-15k:test") == "databricks-dolly-15k"
    read_records("owner/name:validation[:2]")
    assert calls[-1] == ("owner/name", "validation[:2]")

    def bad_row(name, split=None, **kw):
        return datasets.Dataset.from_list([dict(DOLLY[1]), {"instruction": "x", "context": "", "response": "", "category": "c"}])

    monkeypatch.setattr(datasets, "load_dataset", bad_row)
    with pytest.raises(DataFormatError, match=re.escape("dataset 'owner/name' (split 'train'), row 1: field 'response' is empty")):
        read_records("owner/name")

    def offline(name, split=None, **kw):
        raise ConnectionError("no internet")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataFormatError, match=r"'owner/missing' is not an existing file or directory and could not be "
                                              r"loaded as a Hugging Face dataset .*ConnectionError: no internet"):
        read_records("owner/missing")


def test_unreachable_hub_data_set_fails_at_once(monkeypatch):
    """No network (this machine has none; forced here): one line naming the id and the offline alternatives, before
    datasets.load_dataset's half-minute of retries."""
    import datasets

    import iprox_lightning.models.hub as hub

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: (False, "huggingface.co"))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("load_dataset must not be tried"))
    with pytest.raises(hub.SourceUnreachable) as e:
        read_records("foo/bar")
    assert str(e.value) == (
        "data source 'foo/bar': data set 'foo/bar' is not a local file or directory, not in the Hugging Face cache, "
        "and huggingface.co cannot be reached within 3 s: pass a local JSONL / JSON / Parquet file or a directory of "
        "them, or download it first (with HF_HUB_OFFLINE=1 the cache is used)")


def test_write_roundtrip(tmp_path):
    recs = read_records(_jsonl(tmp_path / "p.jsonl", DOLLY))
    out = write_records_jsonl(recs[::-1], tmp_path / "sel" / "selected.jsonl")
    assert read_records(out) == recs[::-1]


# ----------------------------------------------------------------------------- error messages
def _err(tmp_path, rows, name="bad.jsonl"):
    p = _jsonl(tmp_path / name, rows)
    with pytest.raises((DataFormatError, FileNotFoundError)) as e:
        read_records(p)
    return str(e.value).replace(str(p), "FILE")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"SFT data file not found: {tmp_path / 'nope.jsonl'}")):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="holds no .jsonl/.json/.parquet files"):
        read_records(tmp_path)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFormatError, match=r"x.csv: unsupported file type '.csv'"):
        read_records(tmp_path / "x.csv")


def test_malformed_json_line(tmp_path):
    msg = _err(tmp_path, [DOLLY[0], DOLLY[1], '{"instruction": "x", "response": }'])
    assert msg == "FILE, line 3: malformed JSON (Expecting value at column 34)"
    (tmp_path / "bad.json").write_text('[\n{"instruction": "x",\n "response": "y",}\n]')
    with pytest.raises(DataFormatError, match=re.escape(f"{tmp_path / 'bad.json'}, line 3: malformed JSON")):
        read_records(tmp_path / "bad.json")


def test_missing_field(tmp_path):
    msg = _err(tmp_path, [DOLLY[0], {"instruction": "Add.", "context": "", "answer": "3"}])
    assert msg == "FILE, line 2: missing field 'response'; the record has fields ['answer', 'context', 'instruction']"
    p = _jsonl(tmp_path / "m.jsonl", [{"instruction": "Add.", "response": "3"}])
    with pytest.raises(DataFormatError, match=re.escape(f"{p}, line 1: missing field 'output' (mapped to 'response')")):
        read_records(p, {"response": "output"})


def test_empty_instruction_and_response(tmp_path):
    assert _err(tmp_path, [dict(DOLLY[0], instruction="  ")]) == "FILE, line 1: field 'instruction' is empty"
    assert _err(tmp_path, [DOLLY[0], dict(DOLLY[1], response="")]) == "FILE, line 2: field 'response' is empty"
    p = _parquet(tmp_path / "e.parquet", [DOLLY[1], dict(DOLLY[1], instruction="")])
    with pytest.raises(DataFormatError, match=re.escape(f"{p}, row 1: field 'instruction' is empty")):
        read_records(p)


def test_wrong_type(tmp_path):
    assert _err(tmp_path, [dict(DOLLY[1], response=3)]) == "FILE, line 1: field 'response' must be a string, got int 3"
    assert _err(tmp_path, [dict(DOLLY[1], context=["a"])]) == "FILE, line 1: field 'context' must be a string, got list ['a']"
    assert _err(tmp_path, [dict(DOLLY[1], id=1.5)]) == "FILE, line 1: field 'id' (id) must be a string or an integer, got float"
    assert _err(tmp_path, ["[1, 2]"]) == "FILE, line 1: expected a JSON object (record), got list [1, 2]"
    (tmp_path / "s.json").write_text(json.dumps({"a": [], "b": []}))
    with pytest.raises(DataFormatError, match="expected a JSON list of records or an object with exactly one list"):
        read_records(tmp_path / "s.json")


def test_bad_messages(tmp_path):
    u = {"role": "user", "content": "Hi"}
    a = {"role": "assistant", "content": "Hello"}
    assert _err(tmp_path, [{"messages": [a, u]}]) == (
        "FILE, line 1: field 'messages': the last message must be an assistant turn (the response), got 'user'")
    assert _err(tmp_path, [{"messages": [u, {"role": "assistant"}]}]) == "FILE, line 1: field 'messages'[1]: missing field 'content'"
    assert _err(tmp_path, [{"messages": [u, {"role": "bot", "content": "x"}]}]) == (
        "FILE, line 1: field 'messages'[1].role must be one of ['system', 'user', 'assistant'], got 'bot'")
    assert _err(tmp_path, [{"messages": [u, dict(a, content=" ")]}]) == (
        "FILE, line 1: field 'messages'[1].content is empty (response turn)")
    assert _err(tmp_path, [{"messages": [a]}]) == (
        "FILE, line 1: field 'messages': no user/system turn before the final assistant turn(s)")
    assert _err(tmp_path, [{"messages": "hi"}]) == "FILE, line 1: field 'messages' must be a non-empty list of messages, got 'hi'"


def test_duplicate_ids(tmp_path):
    msg = _err(tmp_path, [dict(DOLLY[0], id="x"), dict(DOLLY[1], id="y"), dict(DOLLY[1], id="x")])
    assert msg == "FILE, line 3: duplicate id 'x' (first seen at FILE, line 1)"


def test_keep_fields_copies_raw_fields_and_names_a_row_without_one(tmp_path):
    """``keep_fields`` (the stratified sample's ``source``): the raw value on the canonical record, as it is; a row
    without the field is named by file and line."""
    p = _jsonl(tmp_path / "pool.jsonl", [dict(DOLLY[0], source="dolly"), dict(DOLLY[1], source=3)])
    recs = read_records(p, keep_fields=("source",))
    assert [r["source"] for r in recs] == ["dolly", 3]
    assert read_records(p)[0] == {k: v for k, v in recs[0].items() if k != "source"}
    _jsonl(p, [dict(DOLLY[0], source="dolly"), DOLLY[1]])
    with pytest.raises(DataFormatError, match=re.escape("pool.jsonl, line 2: no field 'source'")):
        read_records(p, keep_fields=("source",))
