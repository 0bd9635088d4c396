"""gpemu.integrations.sharing: time-slicing emuGPUs among jobs through a RabbitMQ sharing manager."""
