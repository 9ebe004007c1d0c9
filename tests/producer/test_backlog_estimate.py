"""What the backlog and the cluster view count as a queued request's output still to come."""

from producer.edge.backlog import estimated_output
from shared.schemas import GenerateRequest, SamplingParams


def request(n=1, ignore_eos=False, resume=(), group_resume=(), finished=()):
    return GenerateRequest(
        id="r",
        prompt_ids=[1] * 10,
        created_ms=0,
        n=n,
        resume_ids=list(resume),
        group_resume=[list(g) for g in group_resume],
        finished_choices=list(finished),
        params=SamplingParams(max_new_tokens=100, ignore_eos=ignore_eos),
    )


def test_a_single_request_counts_its_cap_or_the_recent_mean_less_what_it_emitted():
    assert estimated_output(request(), None) == 100
    assert estimated_output(request(), 30.4) == 30
    assert estimated_output(request(resume=[7] * 20), 30.0) == 10
    assert estimated_output(request(resume=[7] * 40), 30.0) == 1  # past the mean: at least one more
    assert estimated_output(request(ignore_eos=True, resume=[7] * 40), 30.0) == 60


def test_a_group_counts_each_open_sample():
    assert estimated_output(request(n=3), 30.0) == 90
    assert estimated_output(request(n=3, ignore_eos=True), 30.0) == 300
    requeued = request(n=3, ignore_eos=True, group_resume=[[7] * 100, [7] * 10, [7] * 50], finished=[0])
    assert estimated_output(requeued, None) == 90 + 50  # choice 0 finished
