"""Router counts without user code: forward hooks that count, every step, the tokens each expert receives.

PLT (eq. 7) needs, per MoE layer, the tokens each expert received and the tokens x top-k routed. Models
nobody here wrote (Hugging Face, torchtitan) expose logits, not counts, so for each MoE layer the layout
found this module hooks, in this order:

1. **The layer's own report** (the protocol a custom MoE layer implements): after each forward, the module at
   the layer's prefix holds ``tokens_per_expert`` (``[N]`` integers: tokens each expert processed in that
   forward, after any capacity drop) and ``tokens_assigned`` (tokens x top-k routed in that forward, before
   drops). The reference model's ``MoELayer`` does. A forward hook on the layer reads them.
2. **Its router** (:attr:`MoeLayer.router`, found by name): a forward hook reads the routing from the router's
   output. An integer tensor ``[..., k]`` is the experts it selected (Mixtral, Qwen-MoE, GraniteMoe and
   DeepSeek-V3 in transformers 5.x, whose grouped top-k with ``e_score_correction_bias`` is counted as it
   selected; torchtitan's router with ``expert_bias``); an integer tensor ``[..., N]`` is a dispatch mask after
   capacity drops (Switch Transformers); otherwise a float ``[..., N]`` tensor is logits, and the top-k of
   them, with the model's own k, is what the layer routes (DBRX, JetMoe, transformers 4.x ``nn.Linear``
   gates). k is the router's or the layer's ``top_k`` attribute, else the model config's
   (:data:`TOP_K_NAMES`, including sub-configs such as DBRX's ``ffn_config.moe_top_k``); Switch is top-1.

A layer with neither has no counts: PLT is *unknown* and :attr:`RouterTap.unknown` says why. ``N`` is the
layer's number of experts from the layout, never an attribute of a module. Only training forwards count: a
module in eval mode (validation) or a forward recomputed inside backward (activation checkpointing) adds
nothing. Counts stay on the router's device until :meth:`RouterTap.take`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from moc_lightning.engine.layout import Layout
from moc_lightning.engine.slots import MoeLayer

TOP_K_NAMES: tuple[str, ...] = (
    "num_experts_per_tok",
    "top_k",
    "moe_top_k",
    "router_top_k",
    "num_selected_experts",
    "moe_topk",
    "experts_per_token",
)
"""Config attributes that hold the experts each token is routed to, as the model families name them."""
TOP1_MODEL_TYPES: frozenset[str] = frozenset({"switch_transformers"})
"""Model types whose routers are top-1 without saying so in their config."""


class RouterCounts(Protocol):
    """One MoE layer's router counts since the last take, as :meth:`PECCheckpointer.record_tokens` reads them: a
    :class:`LayerCounts`, or a layer that counts itself (the reference ``MoELayer``)."""

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``[N]`` int64: tokens each expert received."""

    @property
    def tokens_assigned(self) -> int:
        """Tokens x top-k routed (eq. 7's ``T_i * TopK_i``)."""


@dataclass(frozen=True)
class LayerCounts:
    """One MoE layer's tokens since the last take: what :meth:`PECCheckpointer.record_tokens` reads."""

    tokens_per_expert: torch.Tensor
    """``[N]`` int64: tokens each expert received."""
    tokens_assigned: int
    """Tokens x top-k routed (eq. 7's ``T_i * TopK_i``)."""


class TokenSource(Protocol):
    """Where a training step's router counts come from."""

    @property
    def unknown(self) -> Mapping[str, str]:
        """MoE layer prefix -> why its counts are unknown; empty when every layer is counted."""

    def take(self) -> Sequence[RouterCounts] | None:
        """Each layer's counts since the last take, or ``None`` when any layer's are unknown."""

    def close(self) -> None:
        """Stop counting."""


class ModuleReported:
    """Counts from the ``LightningModule``'s own ``moe_layers()`` (exact post-drop counts of the reference
    model); they take precedence over any hook."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def unknown(self) -> Mapping[str, str]:
        return {}

    def take(self) -> Sequence[Any]:
        return _moe_layers(self.module)

    def close(self) -> None:
        pass


class _Counter:
    """One layer's counts accumulated over the training forwards since the last take."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None
        self.assigned = 0

    def add(self, counts: torch.Tensor, assigned: int) -> None:
        counts = counts.detach().to(torch.int64)
        self.counts = counts if self.counts is None else self.counts + counts.to(self.counts.device)
        self.assigned += int(assigned)

    def take(self) -> LayerCounts:
        counts = torch.zeros(self.num_experts, dtype=torch.int64) if self.counts is None else self.counts
        taken = LayerCounts(counts, self.assigned)
        self.counts, self.assigned = None, 0
        return taken


class RouterTap:
    """Forward hooks on every MoE layer of ``layout`` (its own report, else its router) that count tokens."""

    def __init__(self, model: nn.Module, layout: Layout) -> None:
        config = find_config(model)
        self._counters = [_Counter(layer.num_experts) for layer in layout.moe_layers]
        self._handles: list[RemovableHandle] = []
        self._unknown: dict[str, str] = {}
        for layer, counter in zip(layout.moe_layers, self._counters):
            hook_on, hook, why = _hook_for(model, layer, counter, config, self._unreadable)
            if hook_on is None:
                self._unknown[layer.prefix] = why
            else:
                assert hook is not None  # _hook_for returns a hook with every module it names
                self._handles.append(hook_on.register_forward_hook(hook))

    @property
    def unknown(self) -> Mapping[str, str]:
        return dict(self._unknown)

    def take(self) -> list[LayerCounts] | None:
        counts = [counter.take() for counter in self._counters]
        return None if self._unknown else counts

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _unreadable(self, prefix: str, why: str) -> None:
        self._unknown.setdefault(prefix, why)


def _hook_for(
    model: nn.Module,
    layer: MoeLayer,
    counter: _Counter,
    config: Any,
    unreadable: Callable[[str, str], None],
) -> tuple[nn.Module | None, Callable[..., None] | None, str]:
    """The module to hook for ``layer``, the hook, and (when there is none) why."""
    block = model.get_submodule(layer.prefix)
    if _reports(block):
        return block, _reported_hook(counter), ""
    if layer.router is None:
        return None, None, (
            "no router found (no module named router, gate or gating below it holds a 2-D weight), and the "
            "layer does not report tokens_per_expert/tokens_assigned"
        )
    router = model.get_submodule(layer.router)
    k = model_top_k(router, block, config)
    if k is None:
        return None, None, (
            f"the top-k of router {layer.router!r} could not be read: no top_k attribute on it or on the layer, "
            f"and none of {list(TOP_K_NAMES)} in the model config"
        )
    return router, _router_hook(layer, k, counter, unreadable), ""


def _reported_hook(counter: _Counter) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if _counts_now(module):
            reported = cast(RouterCounts, module)  # hooked only on a layer that _reports its counts
            counter.add(reported.tokens_per_expert, reported.tokens_assigned)

    return hook


def _router_hook(
    layer: MoeLayer, k: int, counter: _Counter, unreadable: Callable[[str, str], None]
) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not _counts_now(module):
            return
        routed = read_routing(output, layer.num_experts, k)
        if routed is None:
            unreadable(layer.prefix, (
                f"router {layer.router!r} returned {_describe(output)}: no [..., {k}] expert indices, "
                f"[..., {layer.num_experts}] dispatch mask or [..., {layer.num_experts}] logits"
            ))
            return
        counter.add(*routed)

    return hook


def read_routing(output: Any, num_experts: int, k: int) -> tuple[torch.Tensor, int] | None:
    """``(tokens per expert [N], tokens x k)`` of one router forward from its output (see the module
    docstring), or ``None`` when the output holds no routing this module can read."""
    tensors = _tensors(output)
    for tensor in tensors:
        if tensor.is_floating_point() or tensor.dim() < 2:
            continue
        if tensor.shape[-1] == k:
            return _bincount(tensor, num_experts), tensor.numel() // k * k
        if tensor.shape[-1] == num_experts:
            return tensor.reshape(-1, num_experts).sum(0), tensor.numel() // num_experts * k
    logits = [t for t in tensors if t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == num_experts]
    if not logits:
        return None
    chosen = logits[-1].detach().reshape(-1, num_experts).topk(k, dim=-1).indices
    return _bincount(chosen, num_experts), chosen.numel()


def _bincount(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert from expert indices; an index outside ``[0, N)`` (a padding or other-rank sentinel)
    counts for no expert. No host sync: the counts stay where the indices are (``torch.bincount`` on CUDA reads the
    indices' minimum and maximum on the host to size its result)."""
    flat = indices.detach().reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return [value for value in values if isinstance(value, torch.Tensor)]


def _describe(output: Any) -> str:
    tensors = _tensors(output)
    return ", ".join(f"{t.dtype} {list(t.shape)}" for t in tensors) if tensors else type(output).__name__


def _counts_now(module: nn.Module) -> bool:
    """A training forward, not one recomputed inside backward by activation checkpointing."""
    return module.training and torch._C._current_graph_task_id() == -1


def model_top_k(router: nn.Module, block: nn.Module, config: Any) -> int | None:
    """The model's own top-k for one MoE layer: the router's or the layer's ``top_k``, else the config's."""
    for module in (router, block):
        value = getattr(module, "top_k", None)
        if isinstance(value, int) and value > 0:
            return value
    for cfg in _configs(config):
        for name in TOP_K_NAMES:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return 1 if getattr(config, "model_type", None) in TOP1_MODEL_TYPES else None


def find_config(model: nn.Module) -> Any:
    """The first Hugging Face-style config (an object with ``model_type``) held by a module of ``model``."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "model_type"):
            return config
    return None


def _configs(config: Any) -> list[Any]:
    """A config and its sub-configs (DBRX's ``ffn_config``, a multimodal model's ``text_config``)."""
    if config is None:
        return []
    return [config, *(v for v in vars(config).values() if hasattr(v, "model_type") and v is not config)]


def token_source(module: nn.Module, layout: Layout) -> TokenSource:
    """The module's ``moe_layers()`` when it returns layers that report their counts (``tokens_per_expert`` and
    ``tokens_assigned``), else hooks on its layers and routers (a ``moe_layers()`` that returns, say, the
    Hugging Face MoE blocks is no source of counts, so the hooks count for it)."""
    layers = _moe_layers(module) if hasattr(module, "moe_layers") else None
    if layers and all(_reports(layer) for layer in layers):
        return ModuleReported(module)
    return RouterTap(module, layout)


def _moe_layers(module: nn.Module) -> Sequence[Any]:
    """The module's own ``moe_layers()``: a method of the user's module, which ``nn.Module``'s typed ``__getattr__``
    (parameters, buffers, submodules) cannot describe."""
    return cast(Callable[[], Sequence[Any]], module.moe_layers)()


def _reports(layer: Any) -> bool:
    return hasattr(layer, "tokens_per_expert") and hasattr(layer, "tokens_assigned")


def unknown_message(unknown: Mapping[str, str]) -> str:
    """Why PLT is unknown, and how to make it known."""
    layers = "; ".join(f"{prefix}: {why}" for prefix, why in unknown.items())
    return (
        f"PLT is unknown: no router counts for {len(unknown)} MoE layer(s) ({layers}). Recoveries report PLT "
        "as unknown and moc/plt is not logged. To measure it, name the router module 'router' or 'gate', give "
        "it or the MoE layer a top_k attribute, or have the MoE layer module set tokens_per_expert ([N] tokens "
        "each expert processed) and tokens_assigned (tokens x top-k) in its forward (see docs/bring-your-own-model.md)"
    )

