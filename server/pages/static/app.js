// ampwatch pages: draw the figures embedded in #figures, and on live pages poll the
// page's ?format=update twin to swap in new figures and panels without a reload.
(function () {
  "use strict";

  // Nothing on a chart may send its data off the machine: no "Share chart" (an upload
  // to Chart Studio), no "Edit in Chart Studio", no link to plot.ly. Fewer buttons also
  // means fewer Tab stops before the tables.
  // A chart's own data as CSV (one row per point: trace, x, y), made in the browser
  // from what is drawn: nothing is fetched or sent.
  // A cell as a spreadsheet reads it: text that starts like a formula (= + - @, tab,
  // CR) gets a leading ' (OWASP's CSV injection advice), so a run or layer named
  // =HYPERLINK(...) is shown, never run; numbers are written as they are.
  function csvCell(value) {
    var text = value === null || value === undefined ? "" : String(value);
    if (typeof value === "string" && /^[=+\-@\t\r]/.test(text)) {
      text = "'" + text;
    }
    return /[",\r\n]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
  }

  // The plain name of a trace or a heatmap row: the figure builders escape names for
  // Plotly's HTML-ish labels (figures.label: html.escape(quote=False)); this undoes it.
  function plainName(name) {
    return typeof name !== "string" ? name :
      name.replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&amp;/g, "&");
  }

  // the loss chart draws each line twice, raw and smoothed, under one legend name: the
  // CSV names them apart so that no series holds two rows a step
  function seriesName(trace) {
    var suffix = { "loss-raw": " (raw)", "loss-smooth": " (smoothed)" }[trace.meta];
    return suffix ? trace.name + suffix : trace.name;
  }

  function downloadCsv(el) {
    var rows = ["trace,x,y"];
    (el._fullData || []).forEach(function (trace) {
      if (!trace.x || !trace.y || trace.type === "heatmap") {
        return;
      }
      for (var i = 0; i < trace.x.length; i++) {
        if (trace.x[i] !== null && trace.x[i] !== undefined) {
          rows.push([plainName(seriesName(trace)), trace.x[i], trace.y[i]].map(csvCell)
            .join(","));
        }
      }
    });
    (el._fullData || []).forEach(function (trace) {
      if (trace.type === "heatmap" && trace.z) {
        Array.prototype.forEach.call(trace.z, function (row, r) {
          Array.prototype.forEach.call(row, function (z, c) {
            var value = trace.meta === "log10" && z !== null ? Math.pow(10, z) : z;
            rows.push([plainName(trace.y[r]), trace.x[c], value].map(csvCell).join(","));
          });
        });
      }
    });
    var link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([rows.join("\n") + "\n"], { type: "text/csv" }));
    link.download = el.id.replace(/^fig-/, "") + ".csv";
    document.body.appendChild(link);
    link.click();
    link.remove();
  }

  var CSV_BUTTON = {
    name: "csv",
    title: "Download data as CSV",
    icon: window.Plotly ? window.Plotly.Icons.disk : undefined,  // pages without charts load no plotly
    click: function (el) {
      downloadCsv(el);
    },
  };

  var PLOT_CONFIG = {
    displaylogo: false,
    modeBarButtonsToAdd: [CSV_BUTTON],
    responsive: true,
    showSendToCloud: false,
    showEditInChartStudio: false,
    showLink: false,
    modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d", "sendDataToCloud",
      "editInChartStudio", "zoomIn2d", "zoomOut2d", "toggleSpikelines",
      "hoverClosestCartesian", "hoverCompareCartesian"],
  };

  function draw(figures, update) {
    Object.keys(figures).forEach(function (name) {
      var el = document.getElementById("fig-" + name);
      if (!el) {
        return;
      }
      var fig = figures[name];
      keepView(el, fig.layout);
      var drawn = update ? Plotly.react(el, fig.data, fig.layout, PLOT_CONFIG)
        : Plotly.newPlot(el, fig.data, fig.layout, PLOT_CONFIG);
      drawn.then(function () {
        hoverValues(el);
        el.rawY = (el._fullData || []).map(function (trace) {
          return trace.y ? Array.prototype.slice.call(trace.y) : null;
        });
        if (update || el.id !== "fig-loss") {
          applyTools(el);  // a live update redraws the server's smoothing: keep the user's
        }
      });
    });
  }

  // What the user chose survives a live update: the zoom (x shared by the step charts,
  // y per chart), the log toggle, and (uirevision) legend clicks.
  var userRange = null;

  function keepView(el, layout) {
    layout.uirevision = "user";
    if (!userRange && layout.xaxis && layout.xaxis.range && el.dataset.zoomShared) {
      sharedRange = layout.xaxis.range.slice();  // the run grew: a reset shows it all
    }
    if (userRange && layout.xaxis && el.dataset.zoomShared) {
      layout.xaxis.range = userRange.slice();
      layout.xaxis.autorange = false;
    }
    if (el.keptY && layout.yaxis) {
      layout.yaxis.range = el.keptY.slice();
      layout.yaxis.autorange = false;
    }
    var tools = document.querySelector(".chart-tools[data-for='" + el.id + "']");
    if (tools && tools.querySelector(".log-axis").checked && layout.yaxis) {
      layout.yaxis.type = "log";
    }
  }

  // The zoom goes in the address (?start=&end=), so a link opens on the same steps. On a
  // time axis the zoom's ends are times: the address keeps the first and last step drawn
  // between them (each point's hover text names its step).
  var pageQuery = window.location.search;

  function rememberZoom(range, el) {
    var query = new URLSearchParams(pageQuery);
    var steps = range && ((query.get("x") || "step") === "step" ? range : stepsIn(el, range));
    if (steps) {
      query.set("start", String(Math.max(0, Math.floor(steps[0]))));
      query.set("end", String(Math.max(0, Math.ceil(steps[1]))));
    }
    var search = query.toString();
    window.history.replaceState(null, "", window.location.pathname +
      (search ? "?" + search : "") + window.location.hash);
  }

  // A time axis's value as a number: relative time is one; wall time comes back from a
  // zoom as a UTC date string ("2026-11-29 01:02:03.4567"), drawn from milliseconds.
  function timeValue(value) {
    if (typeof value === "number") {
      return value;
    }
    var iso = String(value).replace(" ", "T").replace(/(\.\d{3})\d+/, "$1");
    return Date.parse(/[zZ]|[+-]\d\d:?\d\d$/.test(iso) ? iso : iso + "Z");
  }

  // The first and last step drawn between a time axis's `range` on chart `el`; null when
  // none is.
  // A date axis's range comes back in whole milliseconds, so there a step's x is
  // compared at that resolution too.
  function stepsIn(el, range) {
    var low = timeValue(range[0]);
    var high = timeValue(range[1]);
    var resolution = typeof range[0] === "string" ? Math.floor : Number;
    var first = null;
    var last = null;
    (el && el._fullData || []).forEach(function (trace) {
      var xs = trace.x || [];
      var texts = trace.text || [];
      for (var i = 0; i < xs.length; i++) {
        var x = resolution(timeValue(xs[i]));
        var step = parseInt(String(texts[i] || "").replace(/,/g, ""), 10);
        if (x >= low && x <= high && !isNaN(step)) {
          first = first === null ? step : Math.min(first, step);
          last = last === null ? step : Math.max(last, step);
        }
      }
    });
    return first === null ? null : [first, last];
  }

  // Heatmaps coloured by log10 (meta "log10") hover with the value itself: customdata
  // is filled here with 10**z, from the z Plotly decoded.
  function hoverValues(el) {
    var update = [];
    var indices = [];
    (el._fullData || []).forEach(function (trace, i) {
      if (trace.type !== "heatmap" || trace.meta !== "log10" || !trace.z) {
        return;
      }
      update.push(Array.prototype.map.call(trace.z, function (row) {
        return Array.prototype.map.call(row, function (z) {
          return z === null || isNaN(z) ? null : Math.pow(10, z);
        });
      }));
      indices.push(i);
    });
    if (indices.length) {
      Plotly.restyle(el, { customdata: update }, indices);
    }
  }

  // A chart's tools: a smoothing slider (the debiased EMA of figures.smooth) over each
  // "loss-raw" trace into the "loss-smooth" trace after it, or, on charts without that
  // pair (grad norm, step phases), over each line's own values; and a log-axis toggle.
  function ema(values, weight) {
    var last = 0;
    var debias = 0;
    return Array.prototype.map.call(values, function (value) {
      last = last * weight + (1 - weight) * value;
      debias = debias * weight + (1 - weight);
      return last / debias;
    });
  }

  function applyTools(el) {
    var tools = document.querySelector(".chart-tools[data-for='" + el.id + "']");
    if (!tools || !el._fullData) {
      return;
    }
    var weight = Number(tools.querySelector(".smoothing").value);
    var ys = [];
    var indices = [];
    el._fullData.forEach(function (trace, i) {
      var raw = el._fullData[i - 1];
      if (trace.meta === "loss-smooth" && raw && raw.meta === "loss-raw") {
        ys.push(ema(raw.y, weight));
        indices.push(trace.index);
      }
    });
    if (!el._fullData.some(function (trace) { return trace.meta === "loss-smooth"; })) {
      // other charts smooth their own lines, always from the values the server sent
      el._fullData.forEach(function (trace, i) {
        if (trace.type === "scatter" && trace.mode && trace.mode.indexOf("lines") >= 0 &&
            el.rawY && el.rawY[i]) {
          ys.push(weight > 0 ? ema(el.rawY[i], weight) : el.rawY[i].slice());
          indices.push(i);
        }
      });
    }
    if (indices.length) {
      // a restyle of y re-guesses the types of the traces' axes: a date axis (?x=wall)
      // is kept a date, not epoch milliseconds as numbers, and keeps the range it shares
      // with the page's other charts
      var xaxis = el._fullLayout.xaxis;
      if (xaxis.type === "date") {
        Plotly.update(el, { y: ys }, { "xaxis.type": "date",
          "xaxis.range": xaxis.range.slice() }, indices);
      } else {
        Plotly.restyle(el, { y: ys }, indices);
      }
    }
    var log = tools.querySelector(".log-axis").checked ? "log" : "linear";
    if (el.layout.yaxis.type !== log) {
      Plotly.relayout(el, { "yaxis.type": log, "yaxis.autorange": true });
    }
  }

  function chartTools() {
    document.querySelectorAll(".chart-tools").forEach(function (tools) {
      var el = document.getElementById(tools.dataset.for);
      if (!el) {
        return;
      }
      var smoothing = tools.querySelector(".smoothing");
      var log = tools.querySelector(".log-axis");
      var query = new URLSearchParams(pageQuery);
      var name = el.id.replace(/^fig-/, "");
      if (query.has("smooth_" + name)) {
        smoothing.value = query.get("smooth_" + name);
      }
      if (query.has("log_" + name)) {
        log.checked = query.get("log_" + name) === "1";
      }
      tools.querySelectorAll("input").forEach(function (input) {
        input.addEventListener("input", function () {
          // the choice goes in the address, like the zoom
          var kept = new URLSearchParams(window.location.search);
          kept.set("smooth_" + name, smoothing.value);
          kept.set("log_" + name, log.checked ? "1" : "0");
          pageQuery = "?" + kept.toString();
          window.history.replaceState(null, "", window.location.pathname + pageQuery +
            window.location.hash);
          applyTools(el);
        });
      });
    });
  }

  // The page's step charts share one x range (set by the server) and one zoom: zooming
  // one zooms the others; a double click puts all of them back on the page's range.
  var syncing = false;
  var sharedRange = null;

  function stepCharts() {
    return Array.prototype.filter.call(document.querySelectorAll(".plot"), function (el) {
      return el.layout && el.layout.xaxis && el.layout.xaxis.visible !== false &&
        el.layout.xaxis.type !== "category";
    });
  }

  function shareZoom() {
    stepCharts().forEach(function (el) {
      if (el.dataset.zoomShared) {
        return;
      }
      el.dataset.zoomShared = "1";
      if (!sharedRange && el.layout.xaxis.range) {
        sharedRange = el.layout.xaxis.range.slice();
      }
      el.on("plotly_relayout", function (event) {
        if (syncing) {
          return;
        }
        if ("yaxis.range[0]" in event) {
          el.keptY = [event["yaxis.range[0]"], event["yaxis.range[1]"]];
        } else if (event["yaxis.range"]) {
          el.keptY = event["yaxis.range"].slice();
        } else if (event["yaxis.autorange"]) {
          el.keptY = null;
        }
        var range = null;
        if ("xaxis.range[0]" in event) {
          range = [event["xaxis.range[0]"], event["xaxis.range[1]"]];
        } else if (event["xaxis.range"]) {
          range = event["xaxis.range"];
        } else if (event["xaxis.autorange"]) {
          range = sharedRange;
        }
        if (!range) {
          return;
        }
        userRange = range === sharedRange ? null : range.slice();
        rememberZoom(userRange, el);
        syncing = true;
        Promise.all(stepCharts().map(function (other) {
          return Plotly.relayout(other, { "xaxis.range": range.slice() });
        })).finally(function () {
          syncing = false;
        });
      });
    });
  }

  // A heatmap row opens its layer's own view: the figure's meta lists each row's label
  // and link (server/pages/views.py layer_links).
  function followRows() {
    document.querySelectorAll(".plot").forEach(function (el) {
      var meta = el.layout && el.layout.meta;
      if (!meta || !meta.layer_links || el.dataset.rowsFollowed) {
        return;
      }
      el.dataset.rowsFollowed = "1";
      // keyboard users reach each row's layer view through its label: Tab, then Enter
      var labels = meta.layer_rows.map(function (row) {
        return new DOMParser().parseFromString(row, "text/html").documentElement.textContent;
      });
      var focusable = function () {
        el.querySelectorAll(".ytick text").forEach(function (text) {
          var row = labels.indexOf(text.textContent);
          if (row < 0 || text.dataset.linked) {
            return;
          }
          text.dataset.linked = "1";
          text.setAttribute("tabindex", "0");
          text.setAttribute("role", "link");
          text.setAttribute("aria-label", "open the view of layer " + labels[row]);
          text.addEventListener("keydown", function (event) {
            if (event.key === "Enter") {
              window.location.href = meta.layer_links[row];
            }
          });
        });
      };
      focusable();
      el.on("plotly_afterplot", focusable);  // a zoom or an update redraws the ticks
      el.on("plotly_click", function (event) {
        var point = event.points && event.points[0];
        var row = point ? meta.layer_rows.indexOf(point.y) : -1;
        if (row >= 0) {
          window.location.href = meta.layer_links[row];
        }
      });
    });
  }

  function swapPanels(panels) {
    Object.keys(panels).forEach(function (id) {
      var el = document.getElementById(id);
      // a panel the user is typing in (a note) waits for the next update
      if (el && !el.contains(document.activeElement)) {
        // boxes ticked (runs picked to compare) stay ticked across the swap
        var ticked = Array.prototype.map.call(
          el.querySelectorAll("input[type=checkbox]:checked"), function (box) {
            return box.name + "=" + box.value;
          });
        // server-rendered by autoescaping templates
        el.innerHTML = panels[id];
        el.querySelectorAll("input[type=checkbox]").forEach(function (box) {
          if (ticked.indexOf(box.name + "=" + box.value) >= 0) {
            box.checked = true;
          }
        });
      }
    });
  }

  // An update redrawn under a drag would cancel the user's zoom box: it waits for the
  // button to come up.
  var buttonDown = false;
  document.addEventListener("mousedown", function () {
    buttonDown = true;
  }, true);
  document.addEventListener("mouseup", function () {
    buttonDown = false;
  }, true);

  window.addEventListener("blur", function () {
    buttonDown = false;
  });

  function whenButtonUp(apply, waited) {
    waited = waited || 0;
    if (buttonDown && waited < 5000) {  // a lost mouseup holds no update back for long
      window.setTimeout(function () {
        whenButtonUp(apply, waited + 200);
      }, 200);
    } else {
      apply();
    }
  }

  function poll(url, interval) {
    function apply(update) {
      draw(update.figures || {}, true);
      swapPanels(update.panels || {});
      document.body.dataset.updatedAt = String(Date.now());
      // the server says how soon to ask again: sooner while the run reports,
      // later once it went quiet (it may resume), never once it finished
      if (update.poll_ms) {
        window.setTimeout(tick, update.poll_ms);
      }
    }

    function tick() {
      fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then(function (response) {
          if (!response.ok) {
            throw new Error("HTTP " + response.status);
          }
          return response.json();
        })
        .then(function (update) {
          whenButtonUp(function () {
            apply(update);
          });
        })
        .catch(function () {
          // the server may be restarting: keep trying, more slowly
          window.setTimeout(tick, interval * 3);
        });
    }
    window.setTimeout(tick, interval);
  }

  // The step charts' x axis (?x=: step, relative or wall time) is drawn by the server:
  // a choice reopens the page with it, keeping the rest of the address.
  function xAxisChoice() {
    document.querySelectorAll("select.x-axis").forEach(function (select) {
      select.addEventListener("change", function () {
        var query = new URLSearchParams(window.location.search);
        if (select.value === "step") {
          query.delete("x");
        } else {
          query.set("x", select.value);
        }
        var search = query.toString();
        window.location.assign(window.location.pathname + (search ? "?" + search : "") +
          window.location.hash);
      });
    });
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
    xAxisChoice();
    var embedded = document.getElementById("figures");
    if (embedded) {
      draw(JSON.parse(embedded.textContent), false);
      shareZoom();
      followRows();
      chartTools();
    }
    var live = document.querySelector("[data-live-url]");
    if (live) {
      poll(live.dataset.liveUrl, Number(live.dataset.pollMs) || 3000);
    }
  });
})();
