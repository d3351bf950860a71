"""A batch that routes to more experts than the cache has slots is computed in rounds, never fatal (the
expert-cache side of the row cache's overflow; tests/vocab/test_overflow.py has the rows')."""
import pytest
import torch

from ds_maximus.experts import offload_experts

from .tiny_moe import clone, tiny_model


@pytest.mark.parametrize("slots", [1, 3])
def test_batch_routing_to_every_expert_with_fewer_slots_equals_the_model(slots):
    model = tiny_model("mixtral", "eager", num_experts=8, top_k=2)
    ref = clone(model)
    ids = torch.randint(1, 128, (4, 24), generator=torch.Generator().manual_seed(3))
    routed = []  # distinct experts each layer's router picks for the batch (its last output: the indices)
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: routed.append(int(o[-1].unique().numel())))
             for layer in ref.model.layers]
    with torch.no_grad():
        want = ref(ids).logits
    for h in hooks:
        h.remove()
    assert len(routed) == 2 and min(routed) > slots  # so every layer computed in rounds
    handle = offload_experts(model, {"gpu_experts_per_layer": slots})
    try:
        with torch.no_grad():
            got = model(ids).logits
        assert torch.equal(got, want)
        assert handle.stats()["demand_misses"] > 0
    finally:
        handle.close()
