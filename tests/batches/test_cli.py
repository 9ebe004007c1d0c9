"""``lightq batch`` against a real producer server, an rq worker and the fake worker."""

from __future__ import annotations

import asyncio
import json

from lightq.cli import main
from producer.batches.rq_worker import queue
from tests.batches.helpers import chat_line, completion_line, generate_line, jsonl, output_lines, pool
from tests.producer.fake_worker import serving


def lightq(*argv: str) -> int:
    try:
        main(list(argv))
    except SystemExit as exc:
        return exc.code or 0
    return 0


async def test_submit_wait_follows_the_batch_and_writes_its_output(
    settings, tokenizer, worker, run_rq, rq_conn, rq_names, tmp_path, capsys
):
    batch_file, out_file = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_file.write_text(jsonl(completion_line("a"), chat_line("b"), generate_line("c")))
    async with serving(settings, tokenizer) as url, pool(worker, delay_s=0.02):
        cli = asyncio.create_task(
            asyncio.to_thread(
                lightq,
                "batch",
                "submit",
                str(batch_file),
                "--wait",
                "--url",
                url,
                "--output",
                str(out_file),
                "--poll_s",
                "0.05",
            )
        )
        while not queue(rq_names.batch, rq_conn).count:  # submitted: now the rq worker can take it
            await asyncio.sleep(0.02)
        assert await run_rq()
        assert await cli == 0
        captured = capsys.readouterr()
        batch_id = captured.out.strip()
        assert batch_id.startswith("batch_")
        assert "3/3" in captured.err and "completed: 3 completed, 0 failed" in captured.err  # the progress bar
        out = output_lines(out_file.read_text())
        assert [line["custom_id"] for line in out] == ["a", "b", "c"]
        assert all(line["response"]["status_code"] == 200 for line in out)

        assert await asyncio.to_thread(lightq, "batch", "status", batch_id, "--url", url) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "completed"
        assert await asyncio.to_thread(lightq, "batch", "output", batch_id, "--url", url) == 0
        assert output_lines(capsys.readouterr().out) == out


async def test_submit_reports_a_bad_file_and_fails(settings, tokenizer, tmp_path, capsys):
    batch_file = tmp_path / "in.jsonl"
    batch_file.write_text(jsonl(completion_line("a"), {**completion_line("b"), "url": "/v1/nope"}))
    async with serving(settings, tokenizer) as url:
        assert await asyncio.to_thread(lightq, "batch", "submit", str(batch_file), "--url", url) == 1
    assert "400: line 2: url" in capsys.readouterr().err


def test_submit_of_what_is_not_a_file_is_one_line(tmp_path, capsys):
    """A missing path was a traceback, and /dev/zero was read for ever; nothing is sent either way."""
    for path in (str(tmp_path / "missing.jsonl"), "/dev/zero", str(tmp_path)):
        assert lightq("batch", "submit", path, "--url", "http://127.0.0.1:9") == 1
        assert capsys.readouterr().err.strip() == f"lightq batch: {path}: not a file"
