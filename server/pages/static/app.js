// ampwatch pages: draw the figures embedded in #figures, and on live pages poll the
// page's ?format=update twin to swap in new figures and panels without a reload.
(function () {
  "use strict";

  var PLOT_CONFIG = {
    displaylogo: false,
    responsive: true,
    modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"],
  };

  function draw(figures, update) {
    Object.keys(figures).forEach(function (name) {
      var el = document.getElementById("fig-" + name);
      if (!el) {
        return;
      }
      var fig = figures[name];
      if (update) {
        Plotly.react(el, fig.data, fig.layout, PLOT_CONFIG);
      } else {
        Plotly.newPlot(el, fig.data, fig.layout, PLOT_CONFIG);
      }
    });
  }

  function swapPanels(panels) {
    Object.keys(panels).forEach(function (id) {
      var el = document.getElementById(id);
      if (el) {
        // server-rendered by autoescaping templates
        el.innerHTML = panels[id];
      }
    });
  }

  function poll(url, interval) {
    function tick() {
      fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then(function (response) {
          if (!response.ok) {
            throw new Error("HTTP " + response.status);
          }
          return response.json();
        })
        .then(function (update) {
          draw(update.figures || {}, true);
          swapPanels(update.panels || {});
          document.body.dataset.updatedAt = String(Date.now());
          if (update.live) {
            window.setTimeout(tick, interval);
          }
        })
        .catch(function () {
          // the server may be restarting: keep trying, more slowly
          window.setTimeout(tick, interval * 3);
        });
    }
    window.setTimeout(tick, interval);
  }

  function autosubmit() {
    document.querySelectorAll("form[data-autosubmit] select").forEach(function (select) {
      select.addEventListener("change", function () {
        select.form.submit();
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    autosubmit();
    var embedded = document.getElementById("figures");
    if (embedded) {
      draw(JSON.parse(embedded.textContent), false);
    }
    var live = document.querySelector("[data-live-url]");
    if (live) {
      poll(live.dataset.liveUrl, Number(live.dataset.pollMs) || 3000);
    }
  });
})();
