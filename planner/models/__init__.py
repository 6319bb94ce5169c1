"""The model zoo: fxpar's reference GPT and Llama presets (presets), mixture-of-experts and mixed-width
decoders (moe, moe_config, mixed), diffusion transformers (dit), `loss_fn=` for models that return
logits (loss), and the Hugging Face bridge: families built from a config with no download, their
attention and experts (hf, hf_attention, hf_moe, hf_families).

May import: cost_model, passes, runtime — nothing else of the planner."""
