"""GPU/model profiles for the simulated engine, as data.

A profile is what the engine model needs to know about one GPU serving one model: vLLM's scheduler
limits, the size of the KV cache, and four cost constants for the time of one scheduler step. The
constants are derived below from public hardware figures and vLLM logs (the arithmetic is in code, so
the numbers cannot drift from their derivation); docs/simulator.md explains the model and the sources.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One GPU serving one model. Times are seconds; token counts are tokens, not bytes."""

    name: str
    max_num_seqs: int  # most sequences running at once (vLLM --max-num-seqs)
    max_num_batched_tokens: int  # token budget of one scheduler step (vLLM --max-num-batched-tokens)
    num_gpu_blocks: int  # KV cache blocks
    block_size: int  # tokens per KV block
    max_model_len: int  # prompt + output tokens of one sequence
    prefill_s_per_token: float  # compute-bound cost of each uncached prompt token
    decode_base_s: float  # fixed cost of a step that decodes (reading the weights once)
    decode_s_per_seq: float  # cost per decoding sequence in a step
    decode_s_per_kv_token: float  # memory-bound cost per context token read by decoding sequences
    sources: str
    gpu: str = ""  # the GPU's name as NVIDIA's DCGM exporter gives it (modelName); "" for none

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"profile {self.name}: {name} must be >= 1")
        if not 2 <= self.max_model_len <= self.kv_capacity_tokens:
            # vLLM refuses to start when one max-length sequence cannot fit in the KV cache; the model
            # relies on it too: a lone sequence can always run, so preemption cannot deadlock.
            raise ValueError(
                f"profile {self.name}: max_model_len must be in [2, num_gpu_blocks * block_size]"
            )
        for name in ("prefill_s_per_token", "decode_base_s", "decode_s_per_seq", "decode_s_per_kv_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name}: {name} must be >= 0")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


# --- Llama-3-8B in bf16 (Llama-3.1-8B-Instruct has the same architecture) -------------------------
LLAMA3_8B_PARAMS = 8.03e9  # 8,030,261,248 parameters
LLAMA3_8B_FLOPS_PER_TOKEN = 2 * LLAMA3_8B_PARAMS  # one multiply-add per weight per token
LLAMA3_8B_WEIGHT_BYTES = 2 * LLAMA3_8B_PARAMS  # bf16; vLLM logs "Loading model weights took 14.99 GiB"
LLAMA3_8B_WEIGHT_GIB = 14.99
LLAMA3_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K,V) x bf16
BLOCK_SIZE = 16  # vLLM's default on CUDA
BLOCK_BYTES = BLOCK_SIZE * LLAMA3_8B_KV_BYTES_PER_TOKEN  # 2 MiB
GIB = 1024**3

# --- Efficiency assumptions, shared by both GPUs ---------------------------------------------------
BANDWIDTH_EFFICIENCY = 0.77  # measured: vLLM single-stream decode of Llama-3.1-8B on an A100 40GB
PREFILL_MFU = 0.55  # assumed: fraction of dense bf16 peak reached by prefill GEMMs

# --- H100 SXM 80GB ---------------------------------------------------------------------------------
H100_BANDWIDTH = 3.35e12  # bytes/s, HBM3
H100_BF16_DENSE = 989e12  # FLOP/s
H100_VISIBLE_GIB = 79.2  # what CUDA reports for the 80 GB part
H100_OVERHEAD_GIB = 2.8  # assumed: activation peak at 8192 batched tokens + non-torch memory
H100_KV_GIB = 0.9 * H100_VISIBLE_GIB - LLAMA3_8B_WEIGHT_GIB - H100_OVERHEAD_GIB

# --- A10G 24GB (AWS G5) ----------------------------------------------------------------------------
A10G_BANDWIDTH = 600e9  # bytes/s, GDDR6
A10G_BF16_DENSE = 70e12  # FLOP/s, assumed (below the A10's 125 TFLOPS; see docs/simulator.md)
A10G_KV_GIB = 4.17  # measured: vLLM log "KV Cache: 4.17 GiB" for an 8B model at utilization 0.9


def _prefill_s(peak_flops: float) -> float:
    return LLAMA3_8B_FLOPS_PER_TOKEN / (PREFILL_MFU * peak_flops)


def _weights_read_s(bandwidth: float) -> float:
    return LLAMA3_8B_WEIGHT_BYTES / (BANDWIDTH_EFFICIENCY * bandwidth)


def _kv_token_read_s(bandwidth: float) -> float:
    return LLAMA3_8B_KV_BYTES_PER_TOKEN / (BANDWIDTH_EFFICIENCY * bandwidth)


H100_LLAMA3_8B = GpuProfile(
    name="h100-llama3-8b",
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    num_gpu_blocks=int(H100_KV_GIB * GIB // BLOCK_BYTES),
    block_size=BLOCK_SIZE,
    max_model_len=131_072,
    prefill_s_per_token=_prefill_s(H100_BF16_DENSE),
    decode_base_s=_weights_read_s(H100_BANDWIDTH),
    decode_s_per_seq=_prefill_s(H100_BF16_DENSE),
    decode_s_per_kv_token=_kv_token_read_s(H100_BANDWIDTH),
    gpu="NVIDIA H100 80GB HBM3",
    sources="""\
H100 SXM 80GB serving Llama-3.1-8B-Instruct (bf16) with vLLM V1 defaults for the OpenAI server.
- max_num_seqs 1024, max_num_batched_tokens 8192: vLLM's defaults on GPUs with >= 70 GiB that are not
  A100 (EngineArgs.get_batch_defaults,
  https://github.com/vllm-project/vllm/blob/main/vllm/engine/arg_utils.py).
- KV bytes/token: 32 layers x 8 KV heads x 128 dim x 2 (K,V) x 2 bytes = 131,072 B = 128 KiB;
  block_size 16 -> 2 MiB per block.
- num_gpu_blocks 27,386: 0.9 x 79.2 GiB = 71.28 GiB; - 14.99 GiB weights (vLLM log "Loading model
  weights took 14.99 GiB") - 2.8 GiB activation peak and non-torch memory = 53.49 GiB;
  53.49 GiB / 2 MiB = 27,386 blocks = 438,176 tokens. The 2.8 GiB is an assumption, picked so the
  result matches the vLLM scrape in tests/fixtures/metrics/vllm.txt (Llama-3.1-8B-Instruct,
  gpu_memory_utilization 0.9, num_gpu_blocks 27386).
- max_model_len 131,072: Llama 3.1's context length.
- prefill_s_per_token 2.95e-5: 2 x 8.03e9 = 16.06 GFLOP/token; H100 SXM bf16 dense 989 TFLOPS
  (https://www.nvidia.com/en-us/data-center/h100/, https://glennklockwood.com/garden/processors/h100)
  x 0.55 achieved (assumed) = 544 TFLOPS -> 16.06e9 / 544e12 = 29.5 us (~34k prompt tokens/s).
- decode_base_s 6.23e-3: every decode step reads the 16.06 GB of weights; 3.35 TB/s HBM3 x 0.77
  achieved (single-stream vLLM decode of this model on an A100 reached ~77% of the bandwidth roofline,
  https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on) = 2.58 TB/s -> 6.23 ms (~160 tok/s
  for one stream).
- decode_s_per_seq 2.95e-5: each decoded token costs the same 16.06 GFLOP as a prompt token.
- decode_s_per_kv_token 5.08e-8: 131,072 B / 2.58 TB/s.""",
)

A10G_LLAMA3_8B = GpuProfile(
    name="a10g-llama3-8b",
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    num_gpu_blocks=int(A10G_KV_GIB * GIB // BLOCK_BYTES),
    block_size=BLOCK_SIZE,
    max_model_len=8192,
    prefill_s_per_token=_prefill_s(A10G_BF16_DENSE),
    decode_base_s=_weights_read_s(A10G_BANDWIDTH),
    decode_s_per_seq=_prefill_s(A10G_BF16_DENSE),
    decode_s_per_kv_token=_kv_token_read_s(A10G_BANDWIDTH),
    gpu="NVIDIA A10G",
    sources="""\
A10G 24GB (AWS G5) serving an 8B Llama-architecture model (bf16) with vLLM defaults.
- max_num_seqs 256, max_num_batched_tokens 2048: vLLM's defaults for the OpenAI server on GPUs under
  70 GiB (https://github.com/vllm-project/vllm/blob/main/vllm/engine/arg_utils.py).
- num_gpu_blocks 2,135: vLLM on an A10G logged "total GPU memory (22.30 GiB) x utilization (0.90) =
  20.07 GiB; Model weights: 14.99 GiB | Activation memory: 0.85 GiB | KV Cache: 4.17 GiB"
  (DeepSeek-R1-Distill-Llama-8B, same architecture as Llama-3-8B,
  https://github.com/awslabs/data-on-eks/blob/main/website/docs/gen-ai/inference/GPUs/ray-vllm-deepseek.md);
  4.17 GiB / 2 MiB per block = 2,135 blocks = 34,160 tokens.
- max_model_len 8192: a deployment choice; 131,072 would not fit (vLLM refuses a max_model_len above
  the KV capacity).
- prefill_s_per_token 4.17e-4: 16.06 GFLOP/token / (0.55 x 70 TFLOPS). The A10 datasheet gives 125
  TFLOPS bf16 dense; the A10G has less tensor throughput than the A10
  (https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/); 70 TFLOPS is assumed.
- decode_base_s 3.48e-2: 16.06 GB / (600 GB/s x 0.77) = 34.8 ms (~29 tok/s for one stream).
- decode_s_per_seq 4.17e-4: the per-token compute, as for prefill.
- decode_s_per_kv_token 2.84e-7: 131,072 B / 462 GB/s.""",
)

TEST = GpuProfile(
    name="test",
    max_num_seqs=4,
    max_num_batched_tokens=32,
    num_gpu_blocks=32,
    block_size=4,
    max_model_len=96,
    prefill_s_per_token=1e-4,
    decode_base_s=1e-2,
    decode_s_per_seq=1e-3,
    decode_s_per_kv_token=1e-5,
    sources="Made up: a tiny engine (32 blocks of 4 tokens) on which eviction, queueing, chunked "
    "prefill and preemption happen with prompts of a few dozen tokens. Round numbers, not a real GPU.",
)

PROFILES: dict[str, GpuProfile] = {p.name: p for p in (H100_LLAMA3_8B, A10G_LLAMA3_8B, TEST)}
