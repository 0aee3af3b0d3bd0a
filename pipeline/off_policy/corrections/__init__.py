"""One module per off-policy correction, each a hook class of one stage (`pipeline.off_policy.hooks`),
registered by name in `pipeline.off_policy.registry`."""
