"""The admin API (``/admin/models``): list, load, swap and remove served models, behind ``--admin-key``."""
