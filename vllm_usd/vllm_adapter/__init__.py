"""Everything that knows vLLM: the version gate, the patches, the plugin entry point,
the ``custom_class`` proposer, the q buffer and the debug readers."""
