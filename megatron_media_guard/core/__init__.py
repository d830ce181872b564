"""The core check, torch but never torch.distributed or megatron; its modules in the order
they run: docs/ARCHITECTURE.md. ``host.to_host`` is the one device-to-host transfer."""
