"""Inference engines behind one interface: the torch reference engine, and vLLM / SGLang adapters."""
