"""The ceiling's parts that need no build: reading llama-batched-bench's table, and the report's ceiling section."""

from __future__ import annotations

from bench.ceiling import parse_table
from bench.report_markdown import _ceiling, at_every_concurrency, named_tables

# The table llama-batched-bench prints (the layout of llama.cpp's tools/batched-bench), figures made up.
PRINTED = """
main: n_kv_max = 2304, n_batch = 512, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |    128 |    1 |    144 |    0.021 |   761.90 |    1.280 |   100.00 |    1.301 |   110.69 |
|    16 |    128 |    2 |    288 |    0.040 |   800.00 |    1.600 |   160.00 |    1.640 |   175.61 |
|    16 |    128 |    4 |    576 |    0.080 |   800.00 |    2.560 |   200.00 |    2.640 |   218.18 |

llama_perf_context_print:        load time =     120.00 ms
"""


def test_parse_table_reads_s_tg_per_batch_count() -> None:
    assert parse_table(PRINTED) == {1: 100.0, 2: 160.0, 4: 200.0}
    assert parse_table("llama-batched-bench: error: failed to load model") == {}


def test_report_shows_every_system_as_a_fraction_of_the_ceiling() -> None:
    report = {
        "model": "m.gguf",
        "ceiling": {
            "command": "llama-batched-bench -m m.gguf",
            "pp": 16,
            "tg": 128,
            "s_tg": {"1": 100.0, "2": 160.0, "4": 200.0},
        },
    }
    measured = {"neuron-tai single": {1: 90.0, 2: 120.0, 4: 210.0}, "Llama serial": {1: 50.0}}
    tok = at_every_concurrency(measured, [1, 2, 4])
    section = named_tables(_ceiling(report, tok, list(tok), [1, 2, 4]), "Model `m.gguf`:")
    lines = section.splitlines()
    assert "| llama-batched-bench S_TG (tok/s) | 100.0 | 160.0 | 200.0 |" in lines
    assert "| neuron-tai single / ceiling | 0.90 | 0.75 | 1.05 |" in lines
    assert "| Llama serial / ceiling | 0.50 | 0.31 | 0.25 |" in lines  # one figure, every concurrency
    assert lines[lines.index("| llama-batched-bench S_TG (tok/s) | 100.0 | 160.0 | 200.0 |") - 4] == "Model `m.gguf`:"
    assert "Not measured" in _ceiling({"ceiling": None}, tok, list(tok), [1])
