"""One typed run config for all four stages: YAML file + dotted overrides, unknown keys are errors.

    cfg = load_config("configs/smollm2-135m-instruct.yaml", ["train.lr=3e-4", "eval.max_prompts=4"])

Every field carries a `help` string; `describe()` turns them into the text `--help` prints.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from core.run.errors import UserError

# One precision vocabulary for every key: weights (target.dtype), autocast (*.mixed_precision), storage
PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST = ("auto", "fp32", "bf16")
HEAD_LOSSES = ("kl", "lk_alpha", "lk_lambda")  # train.loss (train/loss_kind.py)


def _f(default, help: str, ge=None, gt=None, le=None, choices: tuple | None = None):
    """A config field with its help text, its range (ge/gt/le; for a list, of every item) and, for an enum, its
    choices: all checked when the config loads, so `--dry-run` refuses what a stage would refuse later."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TargetConfig:
    model: str = _f("smollm2-135m-instruct", "alias of an embedded model, or a local HF model dir")
    dtype: str = _f("fp32", "fp32 | bf16 | fp16: the weights' dtype (fp32 on a CPU without native bf16, where bf16 "
                            "matmul is emulated and slow)", choices=PRECISIONS)
    device: str = _f("auto", "auto | cpu | cuda | cuda:N")
    hub_id: str = _f("", "the target's Hugging Face Hub repo id (moonshotai/Kimi-K2.5): the speculators-format "
                         "drafter (drafter-speculators/) names it as its verifier, so `vllm serve <that dir>` alone "
                         "serves target and drafter; empty = vLLM needs the target passed (--model)")
    trust_remote_code: bool = _f(False, "run the Python code a model dir ships (its auto_map: Kimi-K2.5's tokenizer) "
                                        "in every tokenizer, config and model load, and pass --trust-remote-code "
                                        "to the SGLang server; off: such a dir is refused with this key named")

    def __post_init__(self):
        # vLLM 0.33 takes a speculators drafter's verifier only as a Hub id, never a path that exists here
        if self.hub_id and (not re.fullmatch(r"[\w.-]+/[\w.-]+", self.hub_id) or Path(self.hub_id).exists()):
            raise UserError(f"target.hub_id = {self.hub_id!r}: expected a Hugging Face Hub repo id <org>/<name> "
                            "(not a local path), or empty")


@dataclass
class DataGenConfig:
    backend: str = _f("hf", "hf (in-process target) | openai (any OpenAI-compatible server: SGLang, vLLM, "
                            "llama.cpp, OpenRouter) | dataset (the source's own answers, nothing generated)",
                      choices=('hf', 'openai', 'dataset'))
    prompts: str = _f("sharegpt", "sharegpt (embedded ShareGPT V3) or a .json/.jsonl file of prompts")
    on_bad_record: str = _f("strict", "strict (first bad record in a prompt file is an error naming file:line) "
                                      "| skip (skipped and counted by reason)", choices=('strict', 'skip'))
    num_samples: int = _f(256, "conversations to regenerate (taken from the train split)", ge=1)
    heldout_percent: float = _f(2.0, "percent of prompts held out for eval (by a hash of their text up to the first "
                                 "user turn)", ge=0, le=100)
    max_turns: int = _f(1, "user turns regenerated per conversation: 1 = first turn, 0 = all", ge=0)
    n: int = _f(1, "answers per conversation (independent regenerations, ids <id>~<j>)", ge=1)
    self_prompts: int = _f(0, "user turns the target writes itself from its chat template's user header (Magpie), "
                              "answered after data_gen.prompts' own (hf: in-process; openai: /v1/completions; <run>/conversations/"
                              "self_prompts.jsonl); more distinct prompts than a dataset holds", ge=0)
    self_prompt_temperature: float = _f(1.0, "sampling temperature of those user turns", gt=0)
    reasoning: str = _f("drop", "reasoning/<think> text: drop | field (stored, not trained on) | "
                                "render (trained on, with the template's thinking markup)",
                        choices=('drop', 'field', 'render'))
    end_of_turn: list[str] = _f([], "strings that end an assistant turn (default: the tokenizer's eos tokens)")
    chat_template_kwargs: dict = _f({}, "extra chat-template variables, e.g. {enable_thinking: false}")
    max_prompt_tokens: int = _f(256, "conversations whose templated first turn is longer are skipped, with a count", ge=1)
    max_context_tokens: int = _f(4096, "a later turn whose templated prompt is longer ends the conversation there", ge=1)
    max_new_tokens: int = _f(128, "answer length cap; capped answers are kept and flagged finish_reason=length "
                                  "(backend dataset: a longer source answer is cut there and flagged so)", ge=1)
    drop_truncated: bool = _f(False, "leave length-capped conversations out of the data")
    temperature: float = _f(0.0, "0 = greedy", ge=0)
    top_p: float = _f(1.0, "nucleus sampling (openai backend)", gt=0, le=1)
    stop: list[str] = _f([], "extra stop strings (openai backend)")
    request_seed: int | None = _f(None, "seed sent with every request (openai backend; +j for answer j)")
    batch_size: int = _f(16, "prompts generated together (hf backend)", ge=1)
    mixed_precision: str = _f("fp32", "auto | fp32 | bf16: bf16 = prompt prefill under bf16 autocast and decode "
                                      "steps with a bf16 copy of the weights (hf backend); auto = bf16 where the "
                                      "device has native bf16", choices=AUTOCAST)
    compile: str = _f("auto", "auto | yes | no | fused | exact: replay each decode step as a CUDA graph (hf "
                              "backend; the same kernels, so the same tokens, hundreds of launches fewer); auto = "
                              "on CUDA; fused = torch.compile the step first (its small kernels fused; bf16 tokens "
                              "may differ from the eager loop's by rounding), as a graph on CUDA; exact = fuse only "
                              "what rounds as eager does (norms, SiLU, RoPE tables stay ATen's)",
                      choices=('auto', 'yes', 'no', 'fused', 'exact'))
    part_samples: int = _f(64, "samples per committed parquet part (resume granularity)", ge=1)
    base_url: str = _f("", "server root incl. /v1, e.g. http://127.0.0.1:30000/v1 (openai backend)")
    model_name: str = _f("", "model name sent to the server (default: target.model)")
    api_key_env: str = _f("OPENAI_API_KEY", "env var holding the API key (never logged); empty = no key")
    concurrency: int = _f(16, "requests in flight (openai backend)", ge=1)
    request_timeout: float = _f(600.0, "seconds per request before it is retried", gt=0)
    max_retries: int = _f(8, "retries per request (429/5xx/timeouts/resets/malformed bodies)", ge=0)
    backoff_base: float = _f(1.0, "first retry waits up to this many seconds, doubling each time", ge=0)
    backoff_max: float = _f(60.0, "cap of one backoff wait (a longer Retry-After is still honoured)", ge=0)


@dataclass
class ExtractConfig:
    engine: str = _f("hf", "hf (in-process target) | sglang (a server started by scripts/launch_sglang_extract.sh, "
                           "our plugin inside) | vllm (stock vLLM 0.33 started by scripts/launch_vllm_extract.sh: "
                           "its extract_hidden_states method, no patch)", choices=('hf', 'sglang', 'vllm'))
    server_url: str = _f("http://127.0.0.1:30000", "sglang / vllm engine: the server's root URL")
    dump_dir: str = _f("", "sglang / vllm engine: the dir the server writes each request's states into, the "
                           "client's too (SGLang's EAGLE3_DUMP_DIR, vLLM's shared_storage_path; default <run>/dumps)")
    max_inflight: int = _f(8, "sglang / vllm engine: requests in flight", ge=1)
    dump_budget_mb: int = _f(4096, "sglang / vllm engine: no new request while the dump dir holds more than this", ge=1)
    request_timeout: float = _f(600.0, "sglang / vllm engine: seconds per request, and per wait for its file", gt=0)
    aux_layers: list[int] | None = _f(None, "input-of-layer ids; default [2, L//2, L-3]", ge=0)
    batch_tokens: int = _f(4096, "token budget of one forward batch", ge=1)
    shard_mb: int = _f(256, "approximate size of one shard file", ge=0)
    dtype: str = _f("bf16", "storage of aux/final: bf16 | fp32 | fp8_e4m3 (one fp32 scale per token and layer: "
                            "~0.5x the bytes of bf16)", choices=("bf16", "fp32", "fp8_e4m3"))
    spans: str = _f("all", "all | loss: final rows only where the loss reads a teacher target (aux stays on "
                           "every token: the drafter attends over the prompt); `python -m extract stats` shows bytes",
                    choices=('all', 'loss'))
    mixed_precision: str = _f("fp32", "auto | fp32 | bf16: bf16 = run the target's matmuls under bf16 autocast "
                                      "(residual stream stays fp32; faster prefill where bf16 is native); auto = bf16 "
                                      "where native", choices=AUTOCAST)


@dataclass
class TrainKernels:
    """How train computes the TTT step, not what it learns: every choice trains the same drafter (the tests hold
    each fast path to the dense reference); a run may resume under other values."""
    attention: str = _f("auto", "auto | dense | flex | cudnn: TTT attention. dense = [T,T] scores (the reference; "
                                "CPU); flex = flex attention, never a [T,T] matrix (CUDA, any pack_length); cudnn = "
                                "cuDNN's causal kernel plus the diagonal terms merged by log-sum-exp (CUDA, one "
                                "document per row; checked against dense on the device before training; on a CPU "
                                "the same merge over PyTorch's CPU flash kernel); auto = cudnn on CUDA for "
                                "right-padded rows, flex for packed rows, dense on CPU",
                        choices=("auto", "dense", "flex", "cudnn"))
    compile: str = _f("auto", "auto | no | unroll: unroll = torch.compile all K TTT steps as one graph (norms, "
                              "RoPE, SiLU fused; weights cast once, their K gradients summed inside it); "
                              "auto = unroll on CUDA, no on CPU", choices=("auto", "no", "unroll"))
    compile_backend: str = _f("inductor", "inductor | aot_eager: torch.compile's backend for the unroll. inductor "
                                          "generates fused kernels (the fast path); aot_eager captures the same "
                                          "graph (dynamo, autograd, functionalization) and runs PyTorch's own "
                                          "kernels: tells a capture fault from a kernel one, and skips inductor's "
                                          "C++ build on a CPU", choices=("inductor", "aot_eager"))
    pack_length: int = _f(0, "> 0: pack each micro-batch's samples into rows of exactly this many tokens, several "
                             "documents per row, kept apart by a document mask (static shapes for compiled steps, "
                             "little padding; trains what the padded batch trains); >= train.max_len; 0 = "
                             "right-padded batches", ge=0)
    loss_chunk: int = _f(8192, "rows per chunk of the fused draft-head loss, which never holds all [T, Vd] logits; "
                               "0 = plain autograd (the reference path)", ge=0)
    activation_checkpointing: bool = _f(False, "recompute each TTT step's layer in the backward: less memory, "
                                               "about a third more layer compute")
    bf16_weights: bool = _f(False, "trainable weights and their gradients in bf16, fp32 masters in the optimizer "
                                   "(train/master_weights.py): a lower step peak, the same total with AdamW; needs "
                                   "train.mixed_precision bf16, not with DeepSpeed")


@dataclass
class TrainMLA:
    """Sizes of an MLA draft layer (train.draft_attention=mla), DeepSeek-V2's names; 0 = the target's own when it is
    MLA (Kimi-K2.5: 1536 / 512 / 128 / 64 / 128), else DeepSeek-V3's proportions to the target's head dim d
    (q 12d at most the hidden size, kv 4d, nope d, rope d/2, v d)."""
    q_lora_rank: int = _f(0, "rank of the query's down-projection (SGLang's MLA draft class needs one)", ge=0)
    kv_lora_rank: int = _f(0, "width of the cached KV latent", ge=0)
    qk_nope_head_dim: int = _f(0, "per-head query/key width without RoPE", ge=0)
    qk_rope_head_dim: int = _f(0, "per-head query/key width with RoPE (the key's is shared by all heads; even)", ge=0)
    v_head_dim: int = _f(0, "per-head value width", ge=0)


@dataclass
class TrainDFlash:
    """A DFlash block drafter (train.drafter = dflash, core/drafters/dflash.py): Qwen3-style layers drafting a block in one
    pass from the target's aux states, with the target's own embedding and LM head."""
    block_size: int = _f(8, "tokens per block: the last accepted token and block_size - 1 masks, so at most "
                            "block_size - 1 drafts per verification (eval.draft_steps is capped there)", ge=2)
    layers: int = _f(1, "draft layers", ge=1)
    anchors: int = _f(64, "blocks trained per sample (anchor positions drawn among the trained tokens)", ge=1)
    mask_token_id: int = _f(-1, "the mask token's id (its embedding is the target's row); -1 = the vocab's last id",
                            ge=-1)


@dataclass
class TrainConfig:
    ttt_steps: int = _f(7, "training-time-test unroll K", ge=1)
    loss_decay: float = _f(0.8, "weight of step k is decay**k", gt=0, le=1)
    loss: str = _f("kl", "kl | lk_alpha | lk_lambda: what each step's head loss drives toward the target (LK losses, "
                         "arXiv 2602.23881). kl = soft cross-entropy; lk_alpha = -log alpha, alpha = sum of "
                         "min(p, q) over the draft vocab, the chance a greedy-verified draft is accepted; lk_lambda "
                         "= lam * kl + (1 - lam) * (1 - alpha), lam = lk_kl_scale * exp(-lk_kl_decay * alpha)",
                   choices=HEAD_LOSSES)
    lk_kl_scale: float = _f(1.0, "lk_lambda: the KL weight at alpha = 0", ge=0, le=1)
    lk_kl_decay: float = _f(3.0, "lk_lambda: how fast the KL weight falls as alpha rises", ge=0)
    draft_vocab_size: int = _f(8192, "rows of the draft lm_head (top tokens by frequency)", ge=1)
    source: str = _f("offline", "offline (hidden shards written by extract) | online (the target runs in the training "
                                "process on each batch, captured as extract would from the conversations: no shards "
                                "on disk, one target forward per batch per epoch)",
                     choices=('offline', 'online'))
    epochs: int = _f(4, "passes over the training data", ge=1)
    batch_size: int = _f(4, "samples per micro-batch (per process)", ge=1)
    grad_accum: int = _f(1, "micro-batches per optimizer step", ge=1)
    max_len: int = _f(2048, "samples are truncated to this many tokens", ge=2)
    lr: float = _f(1e-4, "peak learning rate (AdamW, cosine)", gt=0)
    warmup_ratio: float = _f(0.015, "fraction of steps spent warming up", ge=0, le=1)
    weight_decay: float = _f(0.0, "AdamW weight decay", ge=0)
    grad_clip: float = _f(0.5, "max grad norm", gt=0)
    log_every: int = _f(10, "optimizer steps between log lines", ge=1)
    save_every: int = _f(0, "optimizer steps between checkpoints (0: at each epoch end)", ge=0)
    stop_after: int = _f(0, "end this launch with a checkpoint after this many optimizer steps, without exporting; a "
                            "rerun continues, on any number of processes (job slots shorter than the run); 0 = to the end",
                         ge=0)
    epoch_drafters: bool = _f(False, "also export the drafter at the end of each epoch but the last to "
                                     "train/epochs/epoch-N (SGLang format, ~2 bytes a weight): one to serve or "
                                     "evaluate when a run is cut off later, and τ per epoch")
    log_samples: bool = _f(False, "write train/samples.jsonl: each micro-batch's step, epoch, batch index, rank, sample "
                                  "ids and loss (an audit of what the run trained on; one sync per micro-batch)")
    aux_noise: float = _f(0.0, "uniform noise U(-a, a) added to the RMS-normalised aux features while training "
                               "(EAGLE's feature-noise regulariser against memorising small data)", ge=0)
    loss_on_prompt: bool = _f(False, "also distill the target's predictions at prompt positions (more signal per sample)")
    norm_before_fc: bool = _f(False, "EAGLE-3.1: an RMSNorm (weight input_norm, eps rms_norm_eps) over the concatenated "
                                     "[3H] aux features before fc; exported as config.json norm_before_fc, which "
                                     "SGLang 0.5.23 and llama.cpp b11434 read")
    fc_norm: bool = _f(False, "EAGLE-3.1: an RMSNorm per [H] aux chunk (weights fc_norm.0-2) before fc; exported as "
                              "config.json fc_norm, which SGLang 0.5.23 reads (llama.cpp b11434's converter does "
                              "not: eval's llama.cpp export refuses such a drafter)")
    norm_output: bool = _f(False, "EAGLE-3.1: each draft step after the first reads the previous step's normed "
                                  "output norm(h2) instead of h2, in training and decoding; exported as config.json "
                                  "norm_output, which SGLang 0.5.23 reads (llama.cpp b11434's converter does not)")
    draft_attention: str = _f("gqa", "gqa | mla: the draft layer's attention. gqa = Llama's, the target's heads "
                                     "(LlamaForCausalLMEagle3: SGLang, vLLM, llama.cpp); mla = DeepSeek-V2 multi-latent "
                                     "attention of train.mla's sizes (SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM): its "
                                     "draft KV cache is one latent per token (`make plan` prints both)",
                              choices=("gqa", "mla"))
    mla: TrainMLA = field(default_factory=TrainMLA)
    drafter: str = _f("eagle3", "eagle3 | dflash: the drafter family. dflash = block drafting (train.dflash): one "
                                "pass drafts block_size - 1 tokens; served by llama.cpp (--spec-type draft-dflash) "
                                "and SGLang's DFlashDraftModel", choices=("eagle3", "dflash"))
    dflash: TrainDFlash = field(default_factory=TrainDFlash)
    init_lm_head_from_target: bool = _f(True, "start lm_head (and norm) from the target's rows of the draft vocab")
    freeze_lm_head: bool = _f(False, "keep that lm_head fixed (fewer trainable parameters for small data)")
    wandb_mode: str = _f("offline", "offline | online | disabled", choices=('offline', 'online', 'disabled'))
    wandb_project: str = _f("eagle3", "W&B project")
    mixed_precision: str = _f("auto", "auto | fp32 | bf16: the step's matmuls under bf16 autocast or not; auto = "
                                      "bf16 on GPUs and on CPUs with native bf16 (AVX512-BF16/AMX), fp32 elsewhere "
                                      "(emulated bf16 is far slower there)", choices=AUTOCAST)
    tau_every: int = _f(0, "optimizer steps between τ measurements (eval's hf engine on the drafter as exported, "
                           "greedy chain of K = eval.draft_steps, on eval's prompts), also at the last step; "
                           "logged with loss_k / acc_k; 0 = off", ge=0)
    tau_prompts: int = _f(4, "prompts per τ measurement (the first of eval's prompts)", ge=1)
    tau_new_tokens: int = _f(48, "tokens generated per prompt in a τ measurement", ge=1)
    kernels: TrainKernels = field(default_factory=TrainKernels)

    def __post_init__(self):
        if self.drafter == "dflash" and (self.draft_attention != "gqa" or self.norm_before_fc or self.fc_norm
                                         or self.norm_output or self.tau_every or self.kernels.pack_length):
            raise UserError("train.drafter = dflash takes none of EAGLE-3's variants (draft_attention mla, "
                            "norm_before_fc, fc_norm, norm_output), train.tau_every or train.kernels.pack_length")
        if self.draft_attention == "mla" and self.norm_before_fc:
            raise UserError("train.norm_before_fc with train.draft_attention = mla: SGLang 0.5.23's MLA draft class "
                            "(Eagle3DeepseekV2ForCausalLM) has no input norm; use train.fc_norm, or draft_attention gqa")
        if 0 < self.kernels.pack_length < self.max_len:  # a sample of max_len tokens must fit a row
            raise UserError(f"train.kernels.pack_length = {self.kernels.pack_length}: must be 0 (off) or >= train.max_len "
                            f"({self.max_len})")


GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0", "auto")  # convert_hf_to_gguf.py b11434 --outtype


@dataclass
class EvalConfig:
    prompts: str = _f("heldout", "heldout (held-out ShareGPT) or a .jsonl file (MT-Bench / prompt / ShareGPT)")
    max_prompts: int = _f(16, "prompts evaluated", ge=1)
    max_new_tokens: int = _f(96, "tokens generated per prompt", ge=1)
    draft_steps: int = _f(5, "chain length K drafted per verification", ge=1)
    draft_p_min: float = _f(0.0, "stop a chain at a draft whose probability (softmax over the drafter's 10 likeliest "
                                 "tokens) is below this, as llama.cpp's --spec-draft-p-min; 0 = always K; hf and "
                                 "llamacpp engines, greedy chain; τ then counts the verifications that drafted", ge=0)
    draft_tree: list[int] = _f([], "[depth, topk, total]: an EAGLE-2 tree of `total` drafted tokens per verification "
                                   "instead of a chain (hf engine, T=0); [] = chain", ge=1)
    temperature: float = _f(0.0, "0 = greedy (outputs must equal the baseline's); > 0 = speculative sampling, "
                                 "chain only (hf engine), outputs follow the target's distribution", ge=0)
    engine: str = _f("hf", "hf (our decode engine, in-process) | llamacpp (our drafter converted and served by two "
                           "llama-servers on loopback, beside the hf engine) | server (any base + spec server)",
                     choices=('hf', 'llamacpp', 'server'))
    concurrency: list[int] = _f([1, 4], "requests in flight, one measurement per level (server engines)", ge=1)
    server_type: str = _f("llamacpp", "llamacpp | vllm | sglang: how engine=server asks and counts (server engine)",
                          choices=('llamacpp', 'vllm', 'sglang'))
    server_pass: str = _f("both", "both (base and speculative servers up together, taking turns) | base | spec: one "
                                  "server at a time (a target two copies of which don't fit a node): each pass "
                                  "kept in <out>/passes/, the second one writes the report (server engine)",
                          choices=('both', 'base', 'spec'))
    base_url: str = _f("", "base server root, e.g. http://127.0.0.1:8080 (server engine)")
    spec_url: str = _f("", "speculative server root (server engine)")
    gguf_outtype: str = _f("f32", "f32 | f16 | q8_0: the drafter GGUF (and a converted target GGUF) for llamacpp",
                           choices=GGUF_OUTTYPES)
    target_gguf: str = _f("", "target GGUF for llamacpp (default: the embedded Q4_1 file for SmolLM2, else the "
                              "target converted by llama.cpp's converter into the eval dir)")
    target_outtype: str = _f("", "when target_gguf is unset: f32 | f16 | bf16 | q8_0 converts the target at this "
                                 "type for llamacpp instead of the default above (on a CPU a drafter pays against an "
                                 "unquantized target, whose tokens are bound by reading weights: docs/PERFORMANCE.md)",
                             choices=("", *GGUF_OUTTYPES))

    def __post_init__(self):
        """Checked here, not after the whole HF eval: p_min's setting."""
        if self.draft_p_min > 0 and (self.draft_tree or self.temperature > 0 or self.engine == "server"):
            raise UserError(f"eval.draft_p_min = {self.draft_p_min}: it stops a greedy chain (eval.temperature 0, no "
                            "eval.draft_tree) in the hf and llamacpp engines; for engine=server set the server's own flag")


@dataclass
class RunConfig:
    name: str = _f("smollm2-135m-instruct", "run name; run dir defaults to runs/<name>")
    seed: int = _f(0, "seed for everything random")
    run_dir: str = _f("", "output root (default runs/<name>)")
    cache_dir: str = _f("", "model cache (default $EAGLE3_CACHE or ~/.cache/eagle3)")
    threads: int = _f(0, "torch threads per process; 0 = $OMP_NUM_THREADS when set, else the cores idle at start "
                         "(a thread on a core another process holds slows every step; docs/PERFORMANCE.md)", ge=0)
    target: TargetConfig = field(default_factory=TargetConfig)
    data_gen: DataGenConfig = field(default_factory=DataGenConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir or Path("runs") / self.name)


def _check_value(value, tp, where: str):
    """Return value coerced to tp, or raise ValueError naming the field."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_value(value, a, where)
            except ValueError:
                pass
        raise ValueError(f"{where}: expected {tp}, got {value!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        return [_check_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return _from_dict(tp, value, where)
    if tp is float and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:  # YAML 1.1 reads "3e-4" as a string
            return float(value)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if tp is bool and not isinstance(value, bool):
        raise ValueError(f"{where}: expected true/false, got {value!r}")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if not isinstance(value, tp):
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def _from_dict(cls, data: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        inner = [f"{prefix}{f.name}.{unknown[0]}" for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])
                 and unknown[0] in {g.name for g in dataclasses.fields(hints[f.name])}]
        hint = f"; did you mean {inner[0]}?" if inner else ""
        raise ValueError(f"unknown config key {prefix}{unknown[0]}{hint} (known: {', '.join(sorted(names))})")
    # YAML 1.1 reads a bare `no` / `yes` (e.g. compile: yes) as false / true: a str field means the string
    data = {k: {False: "no", True: "yes"}[v] if isinstance(v, bool) and hints[k] is str else v for k, v in data.items()}
    kwargs = {k: _check_value(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return check_ranges(cls(**kwargs), where)


def check_ranges(cfg, where: str = ""):
    """Every field of cfg (and its sections) within its declared range, else a UserError naming the key;
    -> cfg. Run at load and again by code that sets fields afterwards (CLI flags)."""
    for f in dataclasses.fields(cfg):
        key, value = f"{where}.{f.name}" if where else f.name, getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_ranges(value, key)
            continue
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise UserError(f"{key} = {value!r}: must be one of {' | '.join(map(repr, choices))}")
        ge, gt, le = (f.metadata.get(b) for b in ("ge", "gt", "le"))
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (
                    (ge is not None and v < ge) or (gt is not None and v <= gt) or (le is not None and v > le)):
                bound = " and ".join(b for b in (ge is not None and f">= {ge}", gt is not None and f"> {gt}",
                                                 le is not None and f"<= {le}") if b)
                raise UserError(f"{key} = {value!r}: must be {bound}")
    return cfg


def _set_dotted(data: dict, key: str, value) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key}: {p} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config (or defaults), apply `a.b=value` overrides, validate every key."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file not found: {path} (pass --config configs/<name>.yaml)")
        data = _read_yaml(path)
    for ov in overrides or []:
        if "=" not in ov:
            raise UserError(f"override {ov!r}: expected key=value, e.g. train.lr=3e-4")
        key, raw = ov.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise UserError(f"override {ov!r}: the value is not valid YAML") from None
        _set_dotted(data, key.strip(), value)
    try:
        return _from_dict(RunConfig, data, "")
    except ValueError as e:
        raise UserError(f"{path or 'config'}: {e}") from None


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level must be a mapping")
    return data


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


SHARED_SECTIONS = ("target",)


def describe(stage: str | None = None, cls=RunConfig, prefix: str = "") -> str:
    """Help text: every dotted key with its default and its help string; with a stage, only the
    top-level keys, the shared sections and that stage's section."""
    lines = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
            if stage is None or f.name == stage or f.name in SHARED_SECTIONS:
                lines.append(describe(None, typing.get_type_hints(cls)[f.name], f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {prefix}{f.name} = {default!r}: {f.metadata.get('help', '')}")
    return "\n".join(lines)
