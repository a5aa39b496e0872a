"""msgspec transcription of vLLM's KV-event wire format (structs.py) and the fixture generator."""
