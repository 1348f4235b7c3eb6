"""Target models. `transformer`: Llama / Qwen2 / Qwen3 dense decoders; `hybrid`: Qwen3-Next-style
Gated DeltaNet + gated attention.

Both modules offer the same functions over their own cache type, so the engine is
target-agnostic through `family(model)`:

    init_cache(model, B, capacity)
    prefill(model, tokens, lengths, cache, hidden_layers)          -> ForwardOutput (committed)
    decode_step(model, tokens_B, cache, hidden_layers)             -> ForwardOutput (committed)
    forward(model, tokens, positions, cache, block_mask, hidden_layers, parents=None, offset_B=None)
                                                                   -> ForwardOutput (not committed)
    extend(model, tokens, n, cache, hidden_layers)                 -> ForwardOutput (committed: length += n)
    reserve(cache, slots), release(cache)                          scratch for offset_B blocks, and back
    commit(cache, path, n_keep)                                    -> cache
    pad_nodes(cache, num_nodes)                                    a `forward` cache over w nodes, shaped
                                                                   as over num_nodes (verify widths)
    node_state_bytes(config), cache_bytes(config, B, capacity)     memory of a tree block / the cache
    cache_partition(cache)                                         the cache's PartitionSpecs on a mesh
    PARTITION_RULES                                                the parameters' layout on a mesh (one
                                                                   table per family; `specjax.models.sharding`)
    Norm, apply_norm, attention_layer_module(config, rngs),         one attention decoder layer outside the
    attention_decoder_layer(layer, config, idx, x, positions,      stack, over a cache of its own (MTP)
                            cache, attention, offset_B)
"""


from specjax.models import hybrid, transformer  # noqa: E402  (after the docstring's table)


def family(model):
    """The module whose functions run `model`: `hybrid` for a HybridModel, else `transformer`."""
    return hybrid if isinstance(model, hybrid.HybridModel) else transformer
