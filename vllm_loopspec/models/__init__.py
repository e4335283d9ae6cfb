"""vLLM model implementations registered by the plugin."""
