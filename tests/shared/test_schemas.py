import pytest
from pydantic import ValidationError

from shared.chunk_schemas import TokenChunk
from shared.codec import decode, encode, entry, from_entry
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_load import stream_id


def test_request_round_trips_through_a_stream_entry():
    msg = GenerateRequest(id="r", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=5), created_ms=7)
    assert from_entry(GenerateRequest, entry(msg)) == msg
    assert from_entry(GenerateRequest, {b"msg": encode(msg).encode()}) == msg
    assert msg.max_tokens_needed == 8


@pytest.mark.parametrize(
    "bad", [{"max_new_tokens": 0}, {"temperature": 0}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}]
)
def test_sampling_params_reject_out_of_range(bad):
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


def test_greedy_detection():
    assert SamplingParams().is_greedy
    assert not SamplingParams(do_sample=True, temperature=0.7).is_greedy
    assert SamplingParams(do_sample=True, top_k=1).is_greedy


def test_terminal_chunk_has_no_token():
    chunk = TokenChunk(request_id="r", index=3, token_id=None, finished=True, finish_reason="cancelled")
    assert decode(TokenChunk, encode(chunk)) == chunk


def test_meta_fields_drop_none_and_store_enum_values():
    fields = RequestMeta.fields(status=RequestStatus.RUNNING, worker=None, output_tokens=4)
    assert fields == {"status": "running", "output_tokens": "4"}
    assert RequestMeta.from_hash({**fields, "unknown": "x"}).status is RequestStatus.RUNNING
    with pytest.raises(KeyError):
        RequestMeta.fields(nope=1)


def test_stream_ids_compare_numerically():
    assert stream_id("10-2") > stream_id("9-99")
    assert stream_id("10-10") > stream_id("10-9")


def test_a_requeued_groups_progress_defaults_empty_and_is_checked():
    params = SamplingParams(max_new_tokens=5)
    old = '{"id": "g", "prompt_ids": [1], "params": {}, "created_ms": 0, "n": 3}'  # before the fields existed
    fresh = decode(GenerateRequest, old)
    assert fresh.group_resume == [] and fresh.finished_choices == [] and fresh.open_choices == [0, 1, 2]
    assert fresh.emitted(2) == [] and fresh.num_emitted == 0
    resumed = GenerateRequest(
        id="g", prompt_ids=[1], params=params, created_ms=0, n=3, group_resume=[[4], [5, 6], []], finished_choices=[0]
    )
    assert from_entry(GenerateRequest, entry(resumed)) == resumed
    assert resumed.open_choices == [1, 2] and resumed.emitted(1) == [5, 6] and resumed.num_emitted == 3
    single = GenerateRequest(id="s", prompt_ids=[1], params=params, created_ms=0, resume_ids=[7])
    assert single.emitted(0) == [7] and single.open_choices == [0]
    for bad in [
        dict(n=1, group_resume=[[1]]),
        dict(n=3, group_resume=[[1], []]),
        dict(n=3, finished_choices=[0, 1, 2]),
        dict(n=3, finished_choices=[3]),
        dict(n=3, finished_choices=[1, 0]),
        dict(n=1, finished_choices=[0]),
    ]:
        with pytest.raises(ValidationError):
            GenerateRequest(id="g", prompt_ids=[1], params=params, created_ms=0, **bad)
