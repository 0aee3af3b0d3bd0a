"""Inference engines behind one interface: the torch reference engine, and vLLM / SGLang adapters.

Each engine is one module plus one entry in `ENGINES` (`factory.py`); engine modules are imported
only when chosen, so an island that drives vLLM never imports torch's model code.
"""
