"""``python -m service.alerts.rules``: prints the alert settings table of docs/alerts.md."""

import sys

from service.alerts.rules import settings_table

sys.stdout.write(settings_table())
