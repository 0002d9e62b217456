"""normalize() against each engine's real /metrics layout (tests/fixtures/metrics), field by field."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from extproc.publishers import engines
from extproc.publishers.engines import ENGINE_METRICS, EngineLoad, normalize

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def scrape(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


def test_vllm() -> None:
    load = normalize("vllm", scrape("vllm"))
    assert load.num_running == 7.0
    assert load.num_waiting == 2.0
    assert load.kv_cache_usage == 0.4137
    assert load.kv_blocks_total == 27386  # label of vllm:cache_config_info
    assert load.kv_blocks_free is None
    assert load.block_size == 16
    assert load.max_model_len is None
    assert load.gpu_utilization is None
    assert load.prefix_cache_hits == 98112.0
    assert load.prefix_cache_queries == 182304.0
    assert load.prefix_cache_hit_rate is None
    assert load.ttft_sum == 1.328125
    assert load.ttft_count == 5.0
    assert load.tpot_sum == 0.15625  # inter_token_latency_seconds
    assert load.tpot_count == 6.0
    assert load.prompt_tokens == 201877.0  # cached tokens included: the publisher subtracts the hits
    assert load.prefill_seconds == 1.125  # request_prefill_time_seconds_sum, read as a counter
    assert load.preemptions == 3.0  # num_preemptions_total: voids the prefill-rate samples it spans
    assert load.models == ["meta-llama/Llama-3.1-8B-Instruct"]  # http_requests_total has no model
    assert isinstance(load.kv_blocks_total, int) and isinstance(load.block_size, int)


def test_vllm_legacy_names() -> None:
    load = normalize("vllm", scrape("vllm_legacy"))
    assert load.num_running == 4.0
    assert load.num_waiting == 11.0
    assert load.kv_cache_usage == 0.9731  # gpu_cache_usage_perc
    assert load.kv_blocks_total == 7761
    assert load.kv_blocks_free is None
    assert load.block_size == 16
    assert load.max_model_len is None
    assert load.gpu_utilization is None
    assert load.prefix_cache_hits is None
    assert load.prefix_cache_queries is None
    assert load.prefix_cache_hit_rate == 0.2875  # gpu_prefix_cache_hit_rate
    assert load.ttft_sum == 14.5
    assert load.ttft_count == 6.0
    assert load.tpot_sum == 0.3828125  # time_per_output_token_seconds
    assert load.tpot_count == 5.0
    assert load.models == ["Qwen/Qwen2.5-7B-Instruct"]


def test_sglang_two_dp_ranks() -> None:
    load = normalize("sglang", scrape("sglang"))
    assert load.num_running == 21.0  # 12 + 9
    assert load.num_waiting == 3.0  # 3 + 0
    assert load.kv_cache_usage == 0.61  # max(0.52, 0.61)
    assert load.kv_blocks_total == 240000  # two pools of 120000 pages
    assert load.kv_blocks_free is None
    assert load.block_size == 1
    assert load.max_model_len == 40960
    assert load.gpu_utilization is None
    assert load.prefix_cache_hits == 53248.0  # cached_tokens_total, device + host
    assert load.prefix_cache_queries == 160000.0  # prompt_tokens_total
    assert load.prefix_cache_hit_rate == 0.34  # max(0.34, 0.29)
    assert load.ttft_sum == 2.375
    assert load.ttft_count == 4.0
    assert load.tpot_sum == 0.0703125
    assert load.tpot_count == 3.0
    assert load.models == ["Qwen/Qwen3-32B"]


def test_llamacpp_current_build_has_no_kv_signal() -> None:
    load = normalize("llamacpp", scrape("llamacpp"))
    assert load.num_running == 3.0
    assert load.num_waiting == 1.0
    # Evaluated prompt tokens and the time they took: the prefill rate (cached tokens not counted).
    assert asdict(load) == asdict(
        EngineLoad(num_running=3.0, num_waiting=1.0, prompt_tokens=58213.0, prefill_seconds=131.902)
    )
    assert not ENGINE_METRICS["llamacpp"].prompt_tokens_cached and ENGINE_METRICS["vllm"].prompt_tokens_cached


def test_llamacpp_build_before_kv_gauges_were_removed() -> None:
    text = scrape("llamacpp") + (
        "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\n"
        "llamacpp:kv_cache_usage_ratio 0.28125\n"
        "# HELP llamacpp:kv_cache_tokens KV-cache tokens.\n"
        "# TYPE llamacpp:kv_cache_tokens gauge\n"
        "llamacpp:kv_cache_tokens 4608\n"
    )
    assert normalize("llamacpp", text).kv_cache_usage == 0.28125


def test_tgi() -> None:
    load = normalize("tgi", scrape("tgi"))
    assert load.num_running == 14.0  # tgi_batch_current_size
    assert load.num_waiting == 5.0  # tgi_queue_size
    assert load.tpot_sum == 0.1318359375  # tgi_request_mean_time_per_token_duration
    assert load.tpot_count == 5.0
    assert asdict(load) == asdict(
        EngineLoad(num_running=14.0, num_waiting=5.0, tpot_sum=0.1318359375, tpot_count=5.0)
    )


def test_trtllm_behind_triton() -> None:
    load = normalize("trtllm", scrape("trtllm"))
    assert load.num_running == 18.0  # request_type="active"
    assert load.num_waiting == 6.0  # request_type="waiting"
    assert load.kv_cache_usage == 0.655233  # kv_cache_block_type="fraction"
    assert load.kv_blocks_total == 6239
    assert load.kv_blocks_free == 2151
    assert load.block_size == 64  # tokens_per
    assert load.max_model_len is None
    assert load.gpu_utilization == 0.93  # max over two GPUs
    assert load.prefix_cache_hits is None
    assert load.prefix_cache_queries is None
    assert load.prefix_cache_hit_rate is None
    assert load.ttft_sum == pytest.approx(2.059)  # 2059 ms, model="tensorrt_llm" only (not the ensemble)
    assert load.ttft_count == 6.0
    assert load.tpot_sum is None
    assert load.tpot_count is None
    assert load.models == []


def test_trtllm_older_backend_usage_from_blocks() -> None:
    text = "\n".join(
        line
        for line in scrape("trtllm").splitlines()
        if 'request_type="waiting"' not in line and 'kv_cache_block_type="fraction"' not in line
    )
    load = normalize("trtllm", text)
    assert load.num_waiting is None
    assert load.kv_cache_usage == pytest.approx((6239 - 2151) / 6239)


def test_sim_is_the_vllm_row() -> None:
    assert ENGINE_METRICS["sim"] == ENGINE_METRICS["vllm"]
    assert asdict(normalize("sim", scrape("vllm"))) == asdict(normalize("vllm", scrape("vllm")))


MULTI_MODEL = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-8b"} 3.0
vllm:num_requests_running{engine="0",model_name="qwen-7b"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-8b"} 1.0
vllm:num_requests_waiting{engine="0",model_name="qwen-7b"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-8b"} 0.25
vllm:kv_cache_usage_perc{engine="0",model_name="qwen-7b"} 0.75
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama-8b"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="qwen-7b"} 50.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama-8b"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama-8b"} 2.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama-8b"} 0.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="qwen-7b"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="qwen-7b"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="qwen-7b"} 1.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="500"} 1.0
"""


def test_several_series_sum_counts_and_max_fractions() -> None:
    load = normalize("vllm", MULTI_MODEL)
    assert load.num_running == 8.0
    assert load.num_waiting == 5.0
    assert load.kv_cache_usage == 0.75
    assert load.prefix_cache_hits == 150.0
    assert load.ttft_sum == 1.75
    assert load.ttft_count == 5.0
    assert load.kv_blocks_total == 1500
    assert load.block_size == 32
    assert load.models == ["llama-8b", "qwen-7b"]  # de-duplicated, sorted


def test_first_name_present_wins() -> None:
    text = """\
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:time_per_output_token_seconds_count{model_name="m"} 9
vllm:time_per_output_token_seconds_sum{model_name="m"} 9.5
vllm:inter_token_latency_seconds_count{model_name="m"} 4
vllm:inter_token_latency_seconds_sum{model_name="m"} 0.5
"""
    load = normalize("vllm", text)
    assert load.kv_cache_usage == 0.25
    assert (load.tpot_sum, load.tpot_count) == (0.5, 4.0)


def test_sglang_before_page_gauges_reads_cache_config_labels() -> None:
    text = """\
# HELP sglang:cache_config_info Information of the SGLang cache config
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{model_name="m",num_pages="5000",page_size="16"} 1.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{name="old-sglang-model"} 2.0
"""
    load = normalize("sglang", text)
    assert (load.kv_blocks_total, load.block_size) == (5000, 16)
    assert load.num_running == 2.0
    assert load.models == ["m", "old-sglang-model"]


def test_unknown_engine() -> None:
    with pytest.raises(ValueError, match="unknown engine 'ollama'") as err:
        normalize("ollama", scrape("vllm"))
    for known in ("vllm", "sglang", "llamacpp", "tgi", "trtllm", "sim"):
        assert known in str(err.value)


@pytest.mark.parametrize(
    "text",
    [
        "<html><body><h1>404 Not Found</h1></body></html>",
        "this is not prometheus",
        'vllm:num_requests_running{model_name="m" 3\n',
        "vllm:num_requests_running seven\n",
        '# TYPE x gauge\nx{le="1"} abc\n' + "y" * 500,
    ],
)
def test_garbage_is_a_short_value_error(text: str) -> None:
    with pytest.raises(ValueError, match=r"^malformed Prometheus exposition") as err:
        normalize("vllm", text)
    assert type(err.value) is ValueError
    assert len(str(err.value)) < 120


def test_any_parser_failure_becomes_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_text: str) -> list[object]:
        raise IndexError("list index out of range")

    monkeypatch.setattr(engines, "text_string_to_metric_families", broken)
    with pytest.raises(ValueError, match="malformed Prometheus exposition: list index out of range"):
        normalize("vllm", "vllm:num_requests_running 1\n")


def test_nan_inf_negative_and_unparsable_labels_are_missing() -> None:
    text = """\
vllm:num_requests_running{model_name="m"} NaN
vllm:num_requests_waiting{model_name="m"} -1
vllm:kv_cache_usage_perc{model_name="m"} +Inf
vllm:gpu_prefix_cache_hit_rate{model_name="m"} -1
vllm:prefix_cache_hits_total{model_name="a"} 10
vllm:prefix_cache_hits_total{model_name="b"} NaN
vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0
vllm:time_to_first_token_seconds_count{model_name="m"} 3
vllm:time_to_first_token_seconds_sum{model_name="m"} NaN
"""
    load = normalize("vllm", text)
    assert load.num_running is None
    assert load.num_waiting is None
    assert load.kv_cache_usage is None
    assert load.prefix_cache_hit_rate is None
    assert load.prefix_cache_hits is None  # one bad series: no partial sum
    assert load.kv_blocks_total is None  # "None" before the engine has profiled memory
    assert load.block_size == 16
    assert (load.ttft_sum, load.ttft_count) == (None, None)  # a histogram is read whole or not at all


def test_non_integer_block_count_is_missing() -> None:
    text = 'vllm:cache_config_info{block_size="16.5",num_gpu_blocks="1000"} 1.0\n'
    load = normalize("vllm", text)
    assert (load.kv_blocks_total, load.block_size) == (1000, None)


def test_kv_usage_above_one_is_returned_as_read() -> None:
    load = normalize("vllm", 'vllm:kv_cache_usage_perc{model_name="m"} 1.07\n')
    assert load.kv_cache_usage == 1.07


def test_scrape_missing_optional_metrics() -> None:
    text = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
"""
    load = normalize("vllm", text)
    assert asdict(load) == asdict(EngineLoad(num_running=1.0, num_waiting=0.0, models=["m"]))


def test_empty_scrape_is_all_missing() -> None:
    assert asdict(normalize("tgi", "")) == asdict(EngineLoad())


# -- rejected values are named, not silently dropped ---------------------------------------------------
def test_unusable_values_are_listed_with_a_reason() -> None:
    text = """\
vllm:num_requests_running{model_name="m"} NaN
vllm:num_requests_waiting{model_name="m"} -1
vllm:kv_cache_usage_perc{model_name="m"} +Inf
vllm:cache_config_info{block_size="16.5",num_gpu_blocks="None"} 1.0
vllm:time_to_first_token_seconds_count{model_name="m"} 3
vllm:time_to_first_token_seconds_sum{model_name="m"} NaN
"""
    load = normalize("vllm", text)
    assert sorted(load.rejected) == [
        ("block_size", "fractional"),
        ("kv_blocks_total", "not_a_number"),
        ("kv_cache_usage", "infinite"),
        ("num_running", "nan"),
        ("num_waiting", "negative"),
        ("ttft", "nan"),
    ]
    assert not load.has_load_signal()


def test_absurd_block_count_is_read_as_is_and_left_to_the_publisher() -> None:
    # num_gpu_blocks="1e20" is a whole number: normalize returns it; the publisher's range check
    # (tests/test_publisher.py) rejects it. It must not turn into a KV usage either.
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e20"} 1.0\nvllm:num_requests_running 1\n'
    load = normalize("vllm", text)
    assert load.kv_blocks_total == 10**20
    assert load.kv_cache_usage is None


def test_empty_scrape_or_wrong_engine_has_no_load_signal() -> None:
    assert not normalize("vllm", "").has_load_signal()
    assert not normalize("sglang", scrape("vllm")).has_load_signal()  # wrong engine kind configured
    assert normalize("vllm", scrape("vllm")).has_load_signal()


# -- models and LoRA adapters come only from the engine's own series ---------------------------------
def test_models_only_from_the_engines_own_series() -> None:
    text = """\
vllm:num_requests_running{model_name="served"} 1.0
http_requests_total{handler="/v1/chat",model_name="x"} 4.0
python_info{implementation="CPython",model_name="y"} 1.0
sglang:num_running_reqs{model_name="not-this-engine"} 2.0
"""
    assert normalize("vllm", text).models == ["served"]


LORA = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters="old"} 1.7e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql, chat",waiting_lora_adapters="fin"} 1.8e+09
vllm:num_requests_running{model_name="base"} 1.0
"""


def test_lora_adapters_from_the_newest_series() -> None:
    load = normalize("vllm", LORA)
    assert load.lora_adapters == ["chat", "fin", "sql"]  # running and waiting, trimmed, sorted
    assert load.models == ["base"]  # adapters are not models here; lora_requests_info names no model


def test_lora_absent_or_empty() -> None:
    assert normalize("vllm", scrape("vllm")).lora_adapters == []
    text = 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 5\n'
    assert normalize("vllm", text).lora_adapters == []
    assert normalize("sglang", LORA).lora_adapters == []  # not in SGLang's row


# -- SGLang capacity in tokens ----------------------------------------------------------------------------
def test_sglang_capacity_from_max_total_num_tokens() -> None:
    text = """\
sglang:max_total_num_tokens{dp_rank="0",model_name="m"} 120000.0
sglang:max_total_num_tokens{dp_rank="1",model_name="m"} 120000.0
sglang:num_running_reqs{dp_rank="0",model_name="m"} 1.0
"""
    load = normalize("sglang", text)
    assert load.kv_tokens_total == 240000
    assert (load.kv_blocks_total, load.block_size) == (240000, 1)  # pages of one token: exact capacity
    with_page = text + 'sglang:page_size{dp_rank="0",model_name="m"} 16.0\n'
    load = normalize("sglang", with_page)
    assert (load.kv_blocks_total, load.block_size) == (15000, 16)


def test_sglang_page_count_wins_over_token_capacity() -> None:
    load = normalize("sglang", scrape("sglang"))
    assert load.kv_tokens_total == 240000
    assert load.kv_blocks_total == 240000 and load.block_size == 1  # from num_pages / page_size


# -- trtllm-serve ------------------------------------------------------------------------------------------
TRTLLM_SERVE = """\
# HELP trtllm_num_requests_running Number of requests currently running
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="trtllm",model_name="llama"} 5.0
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="trtllm",model_name="llama"} 2.0
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="trtllm",model_name="llama"} 0.42
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{engine_type="trtllm",model_name="llama"} 62762.0
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{engine_type="trtllm",model_name="llama"} 32.0
# TYPE trtllm_time_to_first_token_seconds histogram
trtllm_time_to_first_token_seconds_bucket{engine_type="trtllm",le="+Inf",model_name="llama"} 4.0
trtllm_time_to_first_token_seconds_count{engine_type="trtllm",model_name="llama"} 4.0
trtllm_time_to_first_token_seconds_sum{engine_type="trtllm",model_name="llama"} 1.0
"""


def test_trtllm_serve() -> None:
    load = normalize("trtllm-serve", TRTLLM_SERVE)
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (5.0, 2.0, 0.42)
    assert (load.kv_blocks_total, load.block_size) == (62762, 32)
    assert (load.ttft_sum, load.ttft_count) == (1.0, 4.0)
    assert load.models == ["llama"]
    assert ENGINE_METRICS["trtllm-serve"].metrics_path == "/prometheus/metrics"
    assert not normalize("trtllm", TRTLLM_SERVE).has_load_signal()  # Triton's row does not read these
