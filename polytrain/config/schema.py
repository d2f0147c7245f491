"""The config tree's schema: nested dataclasses with one docstring per field.

Every field carries a one-line docstring (read back for `polytrain train --help`). The
schema knows no model and imports nothing from polytrain: the loader (load.py) reads TOML
and overrides into it, and the model registry (polytrain/models/registry.py) fills in and
checks what depends on the architecture.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def _choices(*values: str) -> Any:
    return field(default=values[0], metadata={"choices": values})


LOGGERS = ("tensorboard", "wandb", "mlflow")
"""The metric sinks run.loggers may name (polytrain/train/loggers.py opens them)."""


@dataclass
class RunConfig:
    name: str = "default"
    """Run name; the run directory is runs/<name> unless out_dir is set."""
    out_dir: str = ""
    """Run directory (config.toml, metrics.jsonl, loss.png, checkpoints/); empty = runs/<name>."""
    seed: int = 1234
    """Seed for weights, data order and sampling; the same seed gives the same run."""
    steps: int = 200
    """Number of optimizer steps to train."""
    log_every: int = 10
    """Steps between metrics.jsonl rows and progress-bar updates."""
    eval_every: int = 50
    """Steps between validation-loss measurements (0 = only at the end)."""
    eval_batches: int = 4
    """Global batches of held-out sequences in one validation pass (the same for every layout)."""
    sample_tokens: int = 64
    """Tokens generated from a prompt at the end of training (0 = no sample)."""
    loggers: str = field(default="", metadata={"names": LOGGERS})
    """Where metrics rows also go: comma-separated or a TOML list of tensorboard, wandb, mlflow (run.tensorboard = true adds tensorboard)."""
    wandb_project: str = ""
    """W&B project of run.loggers' wandb (empty = WANDB_PROJECT, else W&B's default); WANDB_MODE=offline keeps it local."""
    wandb_entity: str = ""
    """W&B entity (user or team) of run.loggers' wandb (empty = WANDB_ENTITY, else your default)."""
    mlflow_experiment: str = ""
    """MLflow experiment of run.loggers' mlflow (empty = MLFLOW_EXPERIMENT_NAME, else 'polytrain'); MLFLOW_TRACKING_URI picks the store."""
    hang_timeout_s: float = 0.0
    """Seconds a step may take before every rank dumps stacks and collectives to <run dir>/hang/ and the attempt ends; 0 = 10x the slowest step (>= 60 s; 900 s for the first); < 0 = off."""


@dataclass
class ModelConfig:
    arch: str = "llama"
    """Model architecture; see polytrain.models.ARCHITECTURES."""
    size: str = "tiny"
    """Size preset of the architecture (llama: tiny ~3M, small ~16M, 125m, 350m, 1b, 7b; custom = none)."""
    dim: int = 0
    """Hidden size (0 = from the size preset)."""
    n_layers: int = 0
    """Number of transformer blocks (0 = from the size preset)."""
    n_heads: int = 0
    """Attention query heads (0 = from the size preset)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; divides n_heads (0 = from the size preset, else n_heads)."""
    ffn_dim: int = 0
    """SwiGLU hidden size (0 = from the size preset)."""
    vocab_size: int = 0
    """Vocabulary size; the BPE tokenizer is trained to this size (0 = from the size preset)."""
    max_seq_len: int = 0
    """Longest sequence RoPE tables are built for (0 = data.seq_len)."""
    head_dim: int = 0
    """Size of one attention head (0 = dim / n_heads; T5 and some Llamas use another)."""
    n_decoder_layers: int = 0
    """t5: decoder blocks (n_layers counts the encoder's; 0 = as many as the encoder)."""
    activation: str = _choices("silu", "gelu", "gelu_tanh", "relu")
    """Feed-forward nonlinearity: silu, gelu (erf), gelu_tanh (GPT-2's and T5's tanh approximation), relu."""
    gated_ffn: bool = True
    """Gated feed-forward w2(act(w1 x) * w3 x) (SwiGLU, T5 v1.1); false = w2(act(w1 x)) (GPT-2, BERT, T5 v1.0)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: str = _choices("none", "linear", "dynamic", "llama3")
    """RoPE context extension: linear (positions / factor), dynamic (NTK, past the original length), llama3."""
    rope_scaling_factor: float = 1.0
    """RoPE scaling factor (e.g. 8 for Llama-3.1, 2 for InternLM2's dynamic NTK)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_len / this are divided by the factor in full."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_len / this are kept; between the two, interpolated."""
    rope_original_max_len: int = 0
    """Context length the RoPE model was pre-trained at, for llama3 and dynamic scaling (0 = max_seq_len)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms (RMSNorm; LayerNorm for gpt2 and bert; T5's RMS-style LayerNorm)."""
    tie_embeddings: bool = False
    """Share the token embedding with the output projection."""
    head: str = _choices("lm", "value")
    """Output: lm = next-token logits; value = one scalar per token (reward model, critic; decoders, untied)."""
    dropout: float = 0.0
    """Dropout probability in training on attention weights, the embedding, attention and MLP outputs (0 = off)."""
    output_scale: bool = False
    """t5: multiply the decoder's final states by dim ** -0.5 before the output projection (T5 v1.0)."""
    type_vocab_size: int = 2
    """bert: token-type (segment) embeddings."""
    rel_pos_buckets: int = 32
    """t5: relative-position buckets of the attention bias (half per direction in the encoder)."""
    rel_pos_max_distance: int = 128
    """t5: distance from which relative positions share the last, logarithmic bucket."""


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the .py sources of the running Python), a path (.txt, .jsonl, .parquet, .arrow, a directory
    of them, a prepared .bin) or hf:NAME[:CONFIG][:SPLIT] (Hugging Face Datasets: a name or a local path)."""
    text_field: str = "text"
    """.jsonl field / .parquet, .arrow and hf: column that holds each document's text."""
    sources: str = field(default="", metadata={"sources": True})
    """Several corpora blended by weight in place of source (left at stdlib): TOML [{path = "...", weight = W}, ...] or "PATH:W,..."."""
    tokenizer: str = "bpe"
    """'bpe' (byte-level BPE trained on the corpus and cached) or a path to a tokenizer.json."""
    seq_len: int = 256
    """Tokens per training sequence."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (chosen by a hash of the document name)."""
    mask_fraction: float = 0.15
    """mlm: share of each sequence's tokens scored (80% [MASK], 10% random, 10% kept); span: share cut out."""
    mean_span_length: float = 3.0
    """span (T5): mean length of the cut-out spans, each replaced by one sentinel."""
    task: str = _choices("lm", "passkey")
    """lm: the corpus's text; passkey: synthetic pass-key retrieval with the corpus as haystack (data/needle.py)."""
    passkey_score: str = _choices("all", "answer")
    """passkey: which targets are scored. all: every next token (the haystack's language modelling
    teaches a small model the copying the task needs); answer: only the key's tokens (sharpens
    long-range retrieval once the copying is there; validation loss is then the retrieval's alone)."""
    packed_documents: bool = False
    """Decoders: attention stays inside each document of a window (ends at end-of-text); positions restart per document."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    global_batch_size: int = 16
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size x dp."""
    batch_rampup_start: int = 0
    """Batch-size ramp-up (Megatron's --rampup-batch-size): the first global batch; 0 = no ramp-up."""
    batch_rampup_increment: int = 0
    """Ramp-up: sequences the global batch grows by at each increment, up to global_batch_size."""
    batch_rampup_samples: int = 0
    """Ramp-up: samples over which the global batch grows from batch_rampup_start to global_batch_size."""
    lr: float = 3e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms, biases or embeddings' gains)."""
    beta1: float = 0.9
    """AdamW and LAMB first-moment decay."""
    beta2: float = 0.95
    """AdamW and LAMB second-moment decay."""
    eps: float = 1e-8
    """AdamW and LAMB epsilon."""
    momentum: float = 0.9
    """SGD and LARS momentum."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all ranks and shards) to this; 0 = no clipping."""
    optimizer: str = _choices("adamw", "lamb", "lars", "sgd")
    """Optimizer: adamw, lamb or lars (per-tensor trust ratios for large batches), or sgd."""
    trust_clip: float = 0.0
    """lamb/lars only: upper bound on each tensor's trust ratio ||w|| / ||update|| (0 = unbounded)."""
    precision: str = _choices("fp32", "bf16", "fp16")
    """bf16/fp16: 16-bit weights and gradients, fp32 master weights and optimizer state (see autocast_only)."""
    grad_accum_dtype: str = _choices("fp32", "param")
    """bf16/fp16 model states: sum gradients over micro-batches in fp32 (ZeRO-1/2, one rank: 4 bytes per
    parameter where 16-bit gradients wait for a reduction, 4/N for the shard), or "param" = in the 16-bit
    gradients (2 and 2/N: less memory; one bf16 Linear's gradient 1.4% off after 256 micro-batches, 0.01%
    in fp32: benchmarks/grad_accum_precision.py). zero 0/3 (FSDP2) always sum in fp32."""
    autocast_only: bool = False
    """bf16/fp16: keep fp32 weights, gradients and optimizer state and only autocast the matmuls (more memory)."""
    loss_scale: float = 0.0
    """fp16 only: 0 = dynamic loss scaling; > 0 = this fixed scale."""
    initial_scale_power: int = 16
    """fp16 only: dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16 only: steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """fp16 only: overflows tolerated (each skips its step) before the scale is halved."""
    min_loss_scale: float = 1.0
    """fp16 only: the dynamic scale never goes below this."""
    lr_schedule: str = _choices("cosine", "ds_warmup", "ds_warmup_decay", "ds_warmup_cosine")
    """cosine = linear warmup then cosine to min_lr; ds_* = DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR."""
    warmup_type: str = _choices("linear", "log")
    """ds_* schedules: shape of the warmup (cosine always warms up linearly)."""
    warmup_start_lr: float = 0.0
    """ds_* schedules: learning rate at the start of the warmup."""
    schedule_steps: int = 0
    """ds_warmup_decay / ds_warmup_cosine: step where the decay ends (0 = run.steps)."""
    objective: str = _choices("auto", "causal", "mlm", "span")
    """Pre-training objective: causal (decoders), mlm (bert), span corruption (t5); auto = the architecture's."""
    activation_checkpoint: str = _choices("none", "full", "selective")
    """Recompute activations in backward to save memory: full = each block, selective = the attention core."""
    chunked_loss: bool = True
    """Output projection + cross-entropy a chunk of tokens at a time, never holding (tokens, vocab) logits
    (also vocabulary-parallel under tp and on a pipeline's last stage; not the 2d-3d grids); false = plain."""
    compile: bool = False
    """torch.compile each transformer block (regional: the blocks share one graph); the cost is reported
    after the first step."""
    attention_fp32: str = _choices("auto", "true", "false")
    """bf16/fp16: run each block's attention core, softmax(q k^T) v, in fp32 (q, k, v upcast, the output
    cast back) where it trains faster: on CPUs that emulate the 16-bit GEMMs for every shape (2.1-2.6x),
    on others for narrow heads and short sequences (head_dim 32 at 256 tokens: 1.3-1.5x) and slower for
    wide heads and long ones. auto = on for a CPU run where the CPU emulates train.precision's GEMMs, or
    whose heads are at most 32 wide at data.seq_len <= 512 (not under context parallelism); true =
    always; false = never (benchmarks/attention_precision.py measures a shape)."""
    host_attention: str = _choices("auto", "true", "false")
    """Run each block's attention core, forward and backward, on polytrain's flash kernel for the host
    CPU (fp32 sums, grouped heads read in place) where the core has no mask (causal or full attention)
    and no attention dropout; other calls keep SDPA. On one Zen 4 core at up to 512 tokens: 1.6-2.0x
    torch's fp32 SDPA, 1.5-2.5x its bf16 one. auto = on for CPU runs in fp32, in bf16 where the CPU
    emulates bf16 GEMMs, and at data.seq_len <= 512 where it has bf16 instructions (torch's bf16 SDPA
    is as fast from 1,024 tokens there); never under context parallelism or on other devices; true =
    on wherever it can run (an error where it cannot); false = never
    (benchmarks/host_flash_attention.py times your heads)."""
    matmul_fp32: str = _choices("auto", "true", "false")
    """bf16/fp16: run the Linear layers' and the chunked loss's products as fp32 GEMMs on the 16-bit
    operands widened, their results rounded back to 16 bits (states, activations and gradients stay
    16-bit). On CPUs without 16-bit dot-product instructions (no AVX512-BF16 or AMX) torch emulates 16-bit
    GEMMs and this runs them 2.4-5x faster. auto = on for CPU runs on such a CPU; true = always;
    false = never (benchmarks/host_gemm.py measures a host)."""
    fp32_gemm: str = _choices("auto", "onednn", "blas")
    """fp32 training on the host CPU: which library runs the Linear layers' and the chunked loss's
    forward and input-gradient products. torch's x86 builds use MKL, whose kernels take a generic code
    path on CPUs not made by Intel; oneDNN's matmul picks its kernels by instruction set and runs those
    products 10-20% faster there (a Zen 4 EPYC). auto = oneDNN on such a CPU, the BLAS elsewhere;
    onednn = always (where torch has oneDNN); blas = never (benchmarks/fp32_gemm.py measures a host)."""


@dataclass
class ParallelConfig:
    nproc: int = 1
    """Local worker processes to start (through torch's elastic launcher); 1 = this process; MIN:MAX = elastic."""
    nproc_min: int = 0
    """Elastic: fewest workers the job goes on with (set by --parallel.nproc MIN:MAX); 0 = not elastic."""
    nproc_start: int = 0
    """Elastic: workers to start with (0 = parallel.nproc); SIGUSR1 to the launcher grows the job to parallel.nproc."""
    elastic: bool = False
    """Fit the layout to whatever world an elastic agent starts, keeping the global batch (--parallel.nproc MIN:MAX sets it)."""
    max_restarts: int = 3
    """Elastic: restarts the local launcher may make (a device lost, workers added, a hang, a worker's exception)."""
    dp: int = -1
    """Data-parallel degree; -1 = whatever the world size leaves."""
    zero: int = field(default=0, metadata={"choices": (0, 1, 2, 3)})
    """0 = replicate everything; 1 = shard optimizer state; 2 = also gradients; 3 = also parameters (FSDP2)."""
    zero_shard: int = -1
    """Ranks one ZeRO-3 shard group spans; -1 = all of dp; a smaller divisor replicates shards across groups (HSDP)."""
    reduce_bucket_mb: float = 25.0
    """ZeRO-1/2: MiB of gradients reduce-scattered together; smaller buckets start during backward sooner."""
    reduce_bucket_auto: bool = False
    """ZeRO-1/2: size the buckets at start from the dp group's measured reduce-scatter latency and bandwidth, at most reduce_bucket_mb."""
    offload: str = _choices("none", "cpu", "nvme")
    """Optimizer offload: ZeRO-1/2 masters and state, ZeRO-3 shards, on the accelerator (none), host (cpu) or files."""
    offload_params: str = _choices("none", "cpu", "nvme")
    """ZeRO-3 parameter offload: shards (with their gradients and optimizer state) in host memory or files (nvme)."""
    nvme_path: str = ""
    """Directory of nvme offload's state files; empty = <run dir>/offload (a temp dir if unknown)."""
    tp: int = 1
    """Tensor-parallel degree: each layer's weights are split over this many consecutive ranks."""
    tp_mode: str = _choices("1d", "2d", "2.5d", "3d")
    """Tensor-parallel scheme: 1d = Megatron's column/row split; 2d, 2.5d, 3d = Colossal-AI's grids."""
    tp_depth: int = 1
    """2.5d only: depth d of the q x q x d grid (tp = q * q * d)."""
    sp: bool = False
    """Megatron sequence parallelism (needs tp > 1): norms and residuals split along the sequence."""
    tp_overlap: bool = True
    """1d tp, eager training: reduce a region's input gradient over tp while its column layers' weight gradients are computed."""
    pp: int = 1
    """Pipeline-parallel degree: the layers are split into this many stages on different ranks."""
    pp_schedule: str = _choices("1f1b", "gpipe", "interleaved", "zero_bubble")
    """Pipeline schedule; interleaved and zero_bubble run pp_virtual_stages stages per rank."""
    pp_microbatches: int = 0
    """Micro-batches per pipeline run; 0 = all of this rank's micro-batches of the step in one run."""
    pp_virtual_stages: int = 2
    """interleaved / zero_bubble: model chunks (virtual stages) each pipeline rank holds."""
    pp_split: str = ""
    """Module names that start stages 2.. (e.g. "layers.2,layers.4"); empty = balanced by layer count."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (mesh axis inside dp, outside tp)."""
    cp_mode: str = _choices("ring", "ulysses", "hybrid")
    """ring: K/V passed around the ranks (zigzag-balanced); ulysses: all-to-all to head shards; hybrid: both."""
    cp_ulysses: int = 1
    """hybrid: Ulysses degree inside each group of ranks (divides cp); the ring runs across cp / cp_ulysses groups."""


@dataclass
class RLHFConfig:
    steps: str = "1,2,3"
    """`polytrain rlhf`: steps to run, by number or name (sft, reward, ppo); finished ones are skipped."""
    algorithm: str = _choices("ppo", "grpo")
    """Step 3's algorithm: ppo (actor, critic, KL-penalised reward, GAE) or grpo (group-normalised, no critic)."""
    data: str = ""
    """Files or directories of preference/demonstration rows, comma-separated; empty = the built-in sorting task."""
    data_weights: str = ""
    """One blending weight per rlhf.data source, comma-separated (empty = 1 each)."""
    data_split: str = "2,4,4"
    """Shares of each preference source for steps 1, 2, 3 (DeepSpeed-Chat's data_split), disjoint parts."""
    prompt_template: str = "{prompt}"
    """A row's prompt as the model reads it: a template with {prompt}, or 'chat' (the tokenizer's chat template)."""
    max_prompt_len: int = 128
    """Longest prompt in tokens; a longer one is an error naming its row."""
    max_new_tokens: int = 128
    """Step 3: longest sampled response in tokens."""
    sft_mask_prompt: bool = False
    """Step 1: score only the response tokens (DeepSpeed-Chat scores the prompt too)."""
    reward_loss: str = _choices("end", "span")
    """Step 2: end = -log sigmoid(r_chosen - r_rejected) at the last tokens; span = DeepSpeed-Chat's divergent span."""
    kl_coef: float = 0.1
    """PPO: per-token reward -kl_coef (log pi - log pi_ref)."""
    reward_clip: float = 5.0
    """Step 3: the reward model's score is clipped to +-reward_clip."""
    gamma: float = 1.0
    """PPO: GAE discount."""
    lam: float = 0.95
    """PPO: GAE lambda."""
    policy_clip: float = 0.2
    """Step 3: PPO's ratio clip 1 +- policy_clip."""
    value_clip: float = 0.2
    """PPO: the critic's values move at most value_clip from the rollout's in the clipped loss."""
    temperature: float = 1.0
    """Step 3: sampling temperature of the rollout; the actor's and the reference's log-probabilities are scored
    at it too, from logits / temperature (0 = greedy sampling, scored at 1)."""
    top_k: int = 0
    """Step 3: sample among the top_k tokens (0 = all)."""
    top_p: float = 1.0
    """Step 3: nucleus sampling mass (1 = all)."""
    group_size: int = 4
    """GRPO: samples per prompt, normalised within their group."""
    grpo_kl_coef: float = 0.04
    """GRPO: weight of the k3 KL penalty to the reference in the loss."""
    ema: bool = False
    """Step 3: also keep an exponential moving average of the actor (DeepSpeed-Chat's actor_ema)."""
    ema_beta: float = 0.992
    """Step 3: EMA decay per step."""
    ptx_coef: float = 0.0
    """Step 3: weight of a language-model loss on step 1's data after each actor step (0 = off; DS-Chat 27.8)."""
    hybrid_engine: bool = True
    """Step 3: sample through the Hybrid Engine (the actor gathered once per rollout, LoRA fused); false = the training layout."""
    inference_tp: int = 1
    """Step 3, hybrid engine: tensor-parallel degree of the generation copy (1 = whole on every rank; > 1 needs the actor at tp 1)."""
    gather_blocks: int = 0
    """Step 3, hybrid engine: blocks gathered out of the actor's shards at a time (0 = all at once; a few when memory is short)."""
    offload_reference: bool = False
    """Step 3: keep the frozen reference in host memory while idle, on the device only for its pass."""
    offload_reward: bool = False
    """Step 3: keep the frozen reward model in host memory while idle, on the device only for its passes."""
    actor_from: str = ""
    """Step 1's starting actor: "" = the [model] section (a preset, weights seeded by name), or an HF model or polytrain run directory."""
    reward_from: str = ""
    """Step 2's starting reward model: "" = the SFT actor, a size preset of the actor's architecture, or an HF / polytrain run directory."""
    sft_steps: int = 0
    """Step 1: optimizer steps (0 = run.steps)."""
    reward_steps: int = 0
    """Step 2: optimizer steps (0 = run.steps)."""
    ppo_steps: int = 0
    """Step 3: rollouts, each followed by ppo_epochs x ppo_mini_batches actor (and critic) steps (0 = run.steps)."""
    ppo_epochs: int = 1
    """Step 3: passes over each rollout's experience (DeepSpeed-Chat's ppo_epochs); from the second update on
    the policy ratio departs from 1 and the clips engage."""
    ppo_mini_batches: int = 1
    """Step 3: mini-batches each rollout's global batch is cut into, in order, one actor (and critic) step each;
    train.global_batch_size / ppo_mini_batches must split over each trained model's data-parallel ranks."""
    sft_lr: float = 0.0
    """Step 1: peak learning rate (0 = train.lr)."""
    reward_lr: float = 0.0
    """Step 2: peak learning rate (0 = train.lr)."""
    actor_lr: float = 0.0
    """Step 3: the actor's peak learning rate (0 = train.lr)."""
    critic_lr: float = 0.0
    """Step 3: the critic's peak learning rate (0 = train.lr)."""
    eval_rows: int = 256
    """Rows held out of steps 2 and 3's parts: step 2's accuracy pairs, step 3's evaluation prompts (at most a quarter)."""
    actor_zero: int = field(default=-1, metadata={"choices": (-1, 0, 1, 2, 3)})
    """Actor (steps 1 and 3): ZeRO stage 0-3 (-1 = parallel.zero)."""
    actor_tp: int = 0
    """Actor (steps 1 and 3): tensor-parallel degree (0 = parallel.tp)."""
    actor_offload: str = _choices("", "none", "cpu", "nvme")
    """Actor (steps 1 and 3): ZeRO-1/2 state offload none / cpu / nvme ("" = parallel.offload)."""
    actor_precision: str = _choices("", "fp32", "bf16", "fp16")
    """Actor (steps 1 and 3): compute precision ("" = train.precision)."""
    reference_zero: int = field(default=-1, metadata={"choices": (-1, 0, 1, 2, 3)})
    """Step 3's frozen reference: 3 shards its parameters, 0-2 replicate them (-1 = the actor's)."""
    reference_tp: int = 0
    """Step 3's reference: tensor-parallel degree (0 = the actor's)."""
    reference_precision: str = _choices("", "fp32", "bf16", "fp16")
    """Step 3's reference: compute precision ("" = the actor's)."""
    reward_zero: int = field(default=-1, metadata={"choices": (-1, 0, 1, 2, 3)})
    """Reward model: ZeRO stage in step 2; frozen in step 3, 3 shards its parameters, 0-2 replicate (-1 = parallel.zero)."""
    reward_tp: int = 0
    """Reward model (steps 2 and 3): tensor-parallel degree (0 = parallel.tp)."""
    reward_offload: str = _choices("", "none", "cpu", "nvme")
    """Reward model (step 2): ZeRO-1/2 state offload ("" = parallel.offload)."""
    reward_precision: str = _choices("", "fp32", "bf16", "fp16")
    """Reward model (steps 2 and 3): compute precision ("" = train.precision)."""
    critic_zero: int = field(default=-1, metadata={"choices": (-1, 0, 1, 2, 3)})
    """Step 3's critic: ZeRO stage 0-3 (-1 = the reward model's)."""
    critic_tp: int = 0
    """Step 3's critic: tensor-parallel degree (0 = the reward model's)."""
    critic_offload: str = _choices("", "none", "cpu", "nvme")
    """Step 3's critic: ZeRO-1/2 state offload ("" = the reward model's)."""
    critic_precision: str = _choices("", "fp32", "bf16", "fp16")
    """Step 3's critic: compute precision ("" = the reward model's)."""
    task_pairs: int = 4000
    """Built-in task: preference rows generated (split by data_split)."""
    task_demos: int = 4000
    """Built-in task: demonstration rows for step 1."""
    task_noise: float = 0.3
    """Built-in task: share of demonstrations with a mistake (room for steps 2-3 to improve on)."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints (0 = only at the end of training)."""
    keep: int = 2
    """Newest complete checkpoints to keep (0 = keep all)."""
    resume: str = "auto"
    """'auto' = newest complete checkpoint (or snapshot) of this run, 'none' = start fresh, or a checkpoint path."""
    snapshot_every: int = 0
    """Steps between host-memory (/dev/shm) snapshots a restart resumes from when newer than the newest checkpoint; 0 = none."""
    async_save: bool = True
    """Write checkpoints in a background thread from a host-memory copy while training goes on (one in flight;
    still atomic); false = training waits for each write. Runs with parallel.offload / offload_params save synchronously."""


@dataclass
class LoRAConfig:
    rank: int = 0
    """Rank r of the low-rank adapters (LoRA) added to the target Linear layers; 0 = no adapters."""
    alpha: float = 16.0
    """Adapter output scale numerator: each adapter adds (alpha / rank) * B A x to its layer's output."""
    dropout: float = 0.0
    """Dropout probability on the adapters' input in training (the base layer sees it undropped)."""
    targets: str = "layers"
    """Comma-separated module-name patterns (DeepSpeed-Chat's lora_module_name): a Linear inside the blocks
    is adapted when a pattern's dot-separated parts, "*" matching any one, appear in a row in its name
    ("layers" = every block Linear; "wq,wv"; "attention"; "layers.0.feed_forward.w1")."""
    only_optimize: bool = True
    """Train only the adapters: the base model is frozen (no gradients, no optimizer state) and
    checkpoints hold only the adapters; false = the adapters and the whole base model train."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    rlhf: RLHFConfig = field(default_factory=RLHFConfig)
    set_keys: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    """`section.key` names the TOML file or the overrides gave (the loader records them)."""

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir or f"runs/{self.run.name}")


SECTIONS: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in fields(Config)
                             if f.name != "set_keys"}


def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[stmt.target.id] = nxt.value.value  # type: ignore[attr-defined]
    return docs


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)]

