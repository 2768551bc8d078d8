"""dsv41: DeepSeek-V4.1-Flash inference appliance."""
__version__ = "0.1.0"
