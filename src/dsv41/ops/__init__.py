"""Operating the appliance: config knobs, systemd integration, watchdog, preflight, canary, deploy.

Nothing here imports torch: these modules run in short-lived systemd helpers and on the deploying machine.
"""
