// The API page: Swagger UI (vendored) over this service's /openapi.json. A file of its own, not an
// inline script, so that the pages' Content-Security-Policy needs no 'unsafe-inline'.
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    layout: "BaseLayout",
    presets: [SwaggerUIBundle.presets.apis],
  });
});
