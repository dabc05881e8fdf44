"""llama-server's calls in the report: its `/metrics` text read, and the calls table's row for it."""

from __future__ import annotations

from pathlib import Path

from bench.report import server_use
from bench.report_markdown import ENGINE_USE_KEYS, _use_row
from bench.rss import preemptions_of
from bench.server_peer import parsed_metrics

# As llama.cpp's server writes it (server_task_result_metrics::to_metrics), shortened.
METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 144
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 130
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 7.5
"""


def test_metrics_are_read_by_name_and_labelled_series_and_comments_are_skipped() -> None:
    expected = {"prompt_tokens_total": 144.0, "n_decode_total": 130.0, "n_busy_slots_per_decode": 7.5}
    assert parsed_metrics(METRICS) == expected


def test_a_runs_calls_and_busy_slots_come_from_the_readings_before_and_after_it() -> None:
    before = {"n_decode_total": 10.0, "n_busy_slots_per_decode": 2.0, "preemptions": 5.0}
    after = {"n_decode_total": 30.0, "n_busy_slots_per_decode": 5.0, "preemptions": 65.0}
    # 20 slots busy over the first 10 calls, 150 over all 30: 130 over the run's 20 calls.
    assert server_use(before, after) == {"batches": 20, "busy_slots": 130, "preemptions": 60}


def test_a_server_that_no_longer_answers_or_counts_nothing_gives_no_figures() -> None:
    reading = {"n_decode_total": 3.0, "n_busy_slots_per_decode": 1.0}
    assert server_use(None, reading) is None
    assert server_use(reading, None) is None
    assert server_use({}, reading) is None
    assert server_use(reading, reading) == {"batches": 0, "busy_slots": 0}  # no pid: no preemptions


def test_the_calls_table_shows_the_servers_busy_slots_and_dashes_for_what_it_does_not_count() -> None:
    m: dict[str, dict[str, dict[int, float]]] = {k: {} for k in ENGINE_USE_KEYS}
    for key, value in {"batches": 128.0, "busy_slots": 1016.0, "preemptions": 256.0}.items():
        m[key] = {"llama-server": {8: value}}
    assert _use_row(m, "llama-server", 8) == ["llama-server", "8", 128.0, "–", "7.94 busy slots", "–", "–", "–", 2.0]


def test_a_nodes_row_shows_its_rows_per_decode_call_and_times() -> None:
    got = {"batches": 175.0, "decode_batches": 174.0, "decode_rows": 1016.0, "llama_decode_s": 26.23}
    got |= {"llama_decode_share": 0.984, "step_s": 26.42, "preemptions": 2893.0}
    m = {k: {"node": {8: got[k]}} if k in got else {} for k in ENGINE_USE_KEYS}
    assert _use_row(m, "node", 8) == ["node", "8", 175.0, 174.0, 5.84, 26.23, "98%", 26.42, 16.53]


def test_preemptions_are_summed_over_the_processs_threads(tmp_path: Path) -> None:
    for tid, switches in ((41, 7), (42, 30)):
        (tmp_path / "41" / "task" / str(tid)).mkdir(parents=True)
        status = f"Name:\tllama-server\nvoluntary_ctxt_switches:\t900\nnonvoluntary_ctxt_switches:\t{switches}\n"
        (tmp_path / "41" / "task" / str(tid) / "status").write_text(status)
    assert preemptions_of(41, tmp_path) == 37
    assert preemptions_of(43, tmp_path) == 0  # gone: no threads left to count
