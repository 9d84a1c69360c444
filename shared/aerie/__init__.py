"""aerie: EAGLE-3 drafters trained on hidden states taken through the engine that serves."""

__version__ = "0.1.0"
