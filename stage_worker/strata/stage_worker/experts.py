"""A mixture of experts in place of a block's feed-forward: a router picks k of n experts for every row, and the
rows go through their experts in one grouped matmul per projection, never a loop over experts.

The routing is llama.cpp's build_moe_ffn for the architectures here (strata.gguf.architectures.Experts): a softmax over
the router's logits for every expert, the k best, and, where the architecture renormalises, their weights divided by
their sum. Each row's k choices become k assignments; sorted by expert, the assignments of one expert are contiguous,
so one grouped matmul (torch's grouped_mm: one kernel over every expert's slice of rows on GPUs) computes every
expert's gate and up projections, and one more its down projection. The outputs, scaled by their weights, are added
back to their rows. Every shape depends on the row count alone, so a decode step stays one CUDA graph.

The experts' matrices are plain values in the compute dtype: the loader dequantises the file's stacked expert
tensors, and the planner counts them at that size (strata.gguf.resident). Shared experts (Qwen 2 MoE's ffn_*_shexp)
are not run: no architecture in the table has them, and the loader refuses a file that does, naming the tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from strata.stage_worker.model_config import ModelConfig
from torch import Tensor, nn


class MixtureOfExperts(nn.Module):
    def __init__(self, config: ModelConfig, *, activation: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.n_expert = config.n_expert
        self.top_k = config.n_expert_used
        self.renormalise = config.renormalise_experts
        self.expert_dim = config.expert_ffn_dim
        self.activation = activation
        self.router: nn.Module = nn.Linear(config.dim, config.n_expert, bias=False)
        # Every expert's gate over its up rows, and its down matrix, in nn.Linear's [out, in] layout per expert.
        self.w_gate_up = nn.Parameter(torch.empty(config.n_expert, 2 * config.expert_ffn_dim, config.dim))
        self.w_down = nn.Parameter(torch.empty(config.n_expert, config.dim, config.expert_ffn_dim))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's experts and their weights: ([N, k] expert ids, [N, k] f32 weights)."""
        probabilities = torch.softmax(self.router(x).float(), dim=-1)  # [N, E]
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)  # [N, k] each
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: Tensor) -> Tensor:
        # x: [N, D] -> [N, D]
        chosen, weights = self.route(x)
        experts = chosen.flatten()  # [N k]: assignment a is row a // k's choice a % k
        order = torch.argsort(experts, stable=True)  # assignments grouped by expert
        rows = order // self.top_k  # [N k] the row of each sorted assignment
        # Where each expert's assignments end in the sorted order; scatter_add rather than bincount, whose output
        # size depends on the values and so waits for the GPU.
        counts = torch.zeros(self.n_expert, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, experts, torch.ones_like(experts, dtype=torch.int32))
        ends = torch.cumsum(counts, dim=0, dtype=torch.int32)  # [E]
        gate_up = F.grouped_mm(x[rows], self.w_gate_up.transpose(-2, -1), offs=ends)  # [N k, 2 F]
        gate, up = gate_up.chunk(2, dim=-1)
        down = F.grouped_mm(self.activation(gate) * up, self.w_down.transpose(-2, -1), offs=ends)  # [N k, D]
        scaled = down * weights.flatten()[order, None].to(down.dtype)
        out: Tensor = torch.zeros_like(x).index_add_(0, rows, scaled)
        return out
