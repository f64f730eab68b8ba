"""The web pages' static files (HTML, CSS, JS and the vendored uPlot), served by ``service.api.pages``."""
