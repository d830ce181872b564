"""megatron_media_guard."""
