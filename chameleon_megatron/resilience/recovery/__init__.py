"""In-job recovery: detection, the controller, regrouping, state transfer, the plugin."""
