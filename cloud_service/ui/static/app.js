/* EdgeLoop review UI: keyboard handling and fetch-based review (no framework, no CDN). */
"use strict";
var EdgeLoop = (function () {
  function csrf() {
    var meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  }

  function api(method, url, body) {
    var init = { method: method, headers: { "Accept": "application/json" }, credentials: "same-origin" };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.headers["X-CSRF-Token"] = csrf();
      init.body = JSON.stringify(body);
    }
    return fetch(url, init).then(function (response) {
      if (response.status === 401) {
        window.location = "/ui/login?next=" + encodeURIComponent(location.pathname + location.search);
        throw new Error("signed out");
      }
      return response.json().then(function (data) {
        if (!response.ok) {
          var error = new Error(data.detail || ("HTTP " + response.status));
          error.status = response.status;
          throw error;
        }
        return data;
      });
    });
  }

  function typing(event) {
    var t = event.target;
    return t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA");
  }

  /* --- queue page ------------------------------------------------------- */
  function queuePage() {
    var rows = Array.prototype.slice.call(document.querySelectorAll("tr.row"));
    var cursor = rows.length ? 0 : -1;
    function mark() {
      rows.forEach(function (r, i) { r.classList.toggle("cursor", i === cursor); });
      if (cursor >= 0) rows[cursor].scrollIntoView({ block: "nearest" });
    }
    mark();
    var all = document.getElementById("select-all");
    if (all) all.addEventListener("change", function () {
      document.querySelectorAll("input.pick").forEach(function (box) { box.checked = all.checked; });
    });
    document.addEventListener("keydown", function (event) {
      if (typing(event) || event.ctrlKey || event.metaKey || event.altKey) return;
      var key = event.key.toLowerCase();
      if ((key === "j" || key === "arrowdown") && cursor < rows.length - 1) { cursor++; mark(); event.preventDefault(); }
      else if ((key === "k" || key === "arrowup") && cursor > 0) { cursor--; mark(); event.preventDefault(); }
      else if (key === " " && cursor >= 0) {
        var box = rows[cursor].querySelector("input.pick"); box.checked = !box.checked; event.preventDefault();
      } else if (key === "enter" && cursor >= 0) {
        rows[cursor].querySelector("a").click(); event.preventDefault();
      } else if (key === "/") {
        var first = document.querySelector("#filters select, #filters input"); if (first) first.focus(); event.preventDefault();
      }
    });
  }

  /* --- review page ------------------------------------------------------ */
  function reviewPage() {
    var root = document.getElementById("review");
    var query = root.dataset.query || "";
    var sample = JSON.parse(document.getElementById("sample-data").textContent);
    var selected = null;
    var undoStack = [];
    var busy = false;
    var pressedAt = null;
    var prefetched = {};
    window.edgeloopTimings = window.edgeloopTimings || [];

    function el(id) { return document.getElementById(id); }
    function say(text, kind) { var m = el("message"); m.textContent = text || ""; m.className = "message " + (kind || ""); }
    // Detection samples are reviewed box by box (boxes.js); the page switches per sample.
    var editor = window.EdgeLoopBoxes && el("boxes") ? EdgeLoopBoxes.editor({
      img: el("image"), svg: el("boxes"), list: el("box-list"), select: el("box-class"),
      count: el("box-count"), onEdit: function (text) { say(text); }
    }) : null;
    function detection() { return editor !== null && sample.task === "detection"; }

    function labelled(node, index, name) {
      // The digit key that picks the class (0-9), then its name; a class known only
      // by its index shows the index once.
      node.textContent = "";
      if (index < 10 && name !== String(index)) {
        var key = document.createElement("span"); key.className = "key"; key.textContent = String(index);
        node.appendChild(key);
      }
      node.appendChild(document.createTextNode(name));
    }

    function bars(container, scores, classes, highlight) {
      container.textContent = "";
      if (!scores) { container.textContent = "no verdict yet"; return; }
      scores.forEach(function (score, i) {
        var row = document.createElement("div");
        row.className = "bar-row" + (i === highlight ? " top" : "");
        var name = document.createElement("span"); name.className = "name"; labelled(name, i, classes[i]);
        var track = document.createElement("span"); track.className = "track";
        var fill = document.createElement("span"); fill.className = "fill"; fill.style.width = (Math.max(0, Math.min(1, score)) * 100).toFixed(1) + "%";
        track.appendChild(fill);
        var value = document.createElement("span"); value.className = "value"; value.textContent = score.toFixed(3);
        row.appendChild(name); row.appendChild(track); row.appendChild(value);
        container.appendChild(row);
      });
    }

    function choose(label) {
      selected = label;
      Array.prototype.forEach.call(el("choices").children, function (b) {
        b.classList.toggle("chosen", Number(b.dataset.label) === label);
      });
    }

    function render(s) {
      sample = s;
      var img = el("image");
      var started = pressedAt;
      pressedAt = null;
      img.onload = function () {
        if (started !== null) window.edgeloopTimings.push(performance.now() - started);
        if (detection()) editor.draw();  // the boxes follow the frame's displayed size
        document.body.dataset.shown = s.sample_id;
      };
      img.src = s.image_url;
      if (img.complete && img.naturalWidth > 0 && img.getAttribute("src") === s.image_url) {
        // Already in cache: onload may not fire again for the same URL.
        img.onload();
      }
      document.body.dataset.sampleId = s.sample_id;
      var meta = el("meta");
      meta.textContent = "";
      [["Sample", s.sample_id], ["Agent", s.agent_id + " · " + s.fleet], ["Captured", s.captured_at],
       ["Model", s.model_version], ["Reason", s.route_reason + (s.review_reasons.length ? " · " + s.review_reasons.join(", ") : "")],
       ["Status", s.status], ["Labels", s.labels.map(function (l) {
         return (l.boxes ? l.boxes.length + (l.boxes.length === 1 ? " box" : " boxes") : s.classes[l.label]) + " by " + l.by;
       }).join("; ") || "none"]
      ].forEach(function (pair) {
        var dt = document.createElement("dt"); dt.textContent = pair[0];
        var dd = document.createElement("dd"); dd.textContent = pair[1];
        if (pair[0] === "Status") dd.id = "status";
        meta.appendChild(dt); meta.appendChild(dd);
      });
      var det = detection();
      el("review").classList.toggle("detection", det);
      el("classification-panel").hidden = det;
      el("detection-panel").hidden = !det;
      el("hint-classification").hidden = det;
      el("hint-detection").hidden = !det;
      if (det) {
        el("det-edge-summary").textContent = s.edge_boxes.length + (s.edge_boxes.length ? " (mean score " + s.edge_confidence.toFixed(2) + ")" : "");
        el("det-teacher-summary").textContent = s.teacher_boxes === null ? "—" : String(s.teacher_boxes.length);
        el("diff-summary").textContent = EdgeLoopBoxes.summary(s);
        editor.load(s);
        history.replaceState(null, "", "/ui/review/" + s.sample_id + (query ? "?" + query : ""));
        prefetchNext(s);
        return;
      }
      el("edge-summary").textContent = s.classes[s.edge_label] + " " + s.edge_confidence.toFixed(2);
      el("teacher-summary").textContent = s.teacher_label === null ? "—" : s.classes[s.teacher_label] + " " + s.teacher_confidence.toFixed(2);
      bars(el("edge-bars"), s.edge_scores, s.classes, s.edge_label);
      bars(el("teacher-bars"), s.teacher_scores, s.classes, s.teacher_label);
      var choices = el("choices");
      choices.textContent = "";
      s.classes.forEach(function (name, i) {
        var b = document.createElement("button");
        b.type = "button"; b.dataset.label = i; labelled(b, i, name);
        b.addEventListener("click", function () { choose(i); });
        choices.appendChild(b);
      });
      choose(s.teacher_label !== null ? s.teacher_label : s.edge_label);
      history.replaceState(null, "", "/ui/review/" + s.sample_id + (query ? "?" + query : ""));
      prefetchNext(s);
    }

    function prefetchNext(s) {
      // Warm the browser cache with the next image so the next sample shows at once.
      api("GET", "/ui/api/samples/" + s.sample_id + "/neighbour?direction=next&" + query).then(function (data) {
        if (data.sample && !prefetched[data.sample.image_url]) {
          var img = new Image(); img.src = data.sample.image_url; prefetched[data.sample.image_url] = img;
        }
      }).catch(function () {});
    }

    function finished() {
      document.body.dataset.shown = "end";
      document.body.dataset.sampleId = "end";
      say("No more samples under this filter. Esc goes back to the queue.", "done");
    }

    function act(action) {
      if (busy) return;
      busy = true;
      var body = { action: action, token: sample.token, query: query };
      var what = "Labelled " + sample.classes[selected] + ": ";
      if (action === "label" && detection()) {
        body.boxes = editor.boxes();
        what = "Labelled " + body.boxes.length + (body.boxes.length === 1 ? " box: " : " boxes: ");
      } else if (action === "label") body.label = selected;
      api("POST", "/ui/api/samples/" + sample.sample_id + "/review", body).then(function (data) {
        undoStack.push(data.undo);
        if (undoStack.length > 50) undoStack.shift();
        say((action === "discard" ? "Discarded " : what) + sample.sample_id.slice(0, 8) + " (U undoes)", "ok");
        if (data.next) render(data.next); else finished();
      }).catch(function (error) {
        say(error.message, error.status === 409 ? "conflict" : "error");
        if (error.status === 409) {
          api("GET", "/ui/api/samples/" + sample.sample_id).then(function (fresh) { var m = el("message").textContent; render(fresh); say(m, "conflict"); });
        }
      }).then(function () { busy = false; });
    }

    function move(direction) {
      if (busy) return;
      busy = true;
      api("GET", "/ui/api/samples/" + sample.sample_id + "/neighbour?direction=" + direction + "&" + query).then(function (data) {
        if (data.sample) { say(""); render(data.sample); } else { pressedAt = null; say(direction === "next" ? "This is the last sample." : "This is the first sample."); }
      }).catch(function (error) { say(error.message, "error"); }).then(function () { busy = false; });
    }

    function undo() {
      // On a detection sample the page's own edits go first, then the reviews sent.
      if (detection() && !busy && editor.undo()) return;
      var last = undoStack.pop();
      if (!last || busy) { say("Nothing to undo."); return; }
      busy = true;
      api("POST", "/ui/api/undo", last).then(function (data) {
        say("Undone: " + last.sample_id.slice(0, 8) + " is " + data.sample.status + " again.", "ok");
        render(data.sample);
      }).catch(function (error) {
        say(error.message, error.status === 409 ? "conflict" : "error");
      }).then(function () { busy = false; });
    }

    el("confirm").addEventListener("click", function () { pressedAt = performance.now(); act("label"); });
    el("discard").addEventListener("click", function () { pressedAt = performance.now(); act("discard"); });
    el("undo").addEventListener("click", undo);
    el("accept-teacher").addEventListener("click", function () { editor.acceptTeacher(); this.blur(); });
    el("accept-edge").addEventListener("click", function () { editor.acceptEdge(); this.blur(); });

    function boxKey(event) {
      // The box editor's keys on a detection sample; true when the key was one of them.
      var key = event.key, step = editor.step;
      var arrows = { ArrowLeft: [-step, 0], ArrowRight: [step, 0], ArrowUp: [0, -step], ArrowDown: [0, step] };
      if (arrows[key] && editor.hasSelection()) editor.nudge(arrows[key][0], arrows[key][1], event.shiftKey);
      else if (key === "Escape" && editor.hasSelection()) editor.deselect();
      else if (key === "Tab") editor.select(event.shiftKey ? -1 : 1);
      else if (key === "Delete" || key === "Backspace") editor.deleteSelected();
      else if (/^[0-9]$/.test(key)) editor.setClass(Number(key));
      else if (key === "t" || key === "T") editor.acceptTeacher();
      else if (key === "e" || key === "E") editor.acceptEdge();
      else return false;
      event.preventDefault();
      return true;
    }

    document.addEventListener("keydown", function (event) {
      if (typing(event) || event.altKey || event.metaKey) return;
      var key = event.key;
      if (event.ctrlKey) { if (key === "z") { undo(); event.preventDefault(); } return; }
      if (detection() && boxKey(event)) return;
      if (/^[0-9]$/.test(key)) {
        var n = Number(key); if (n < sample.classes.length) choose(n); event.preventDefault();
      } else if (key === "Enter") { pressedAt = performance.now(); act("label"); event.preventDefault(); }
      else if (key === "x" || key === "X") { pressedAt = performance.now(); act("discard"); event.preventDefault(); }
      else if (key === "j" || key === "J" || key === "ArrowRight" || key === "ArrowDown") { pressedAt = performance.now(); move("next"); event.preventDefault(); }
      else if (key === "k" || key === "K" || key === "ArrowLeft" || key === "ArrowUp") { pressedAt = performance.now(); move("prev"); event.preventDefault(); }
      else if (key === "u" || key === "U") { undo(); event.preventDefault(); }
      else if (key === "Escape") { window.location = "/ui/queue?" + query; }
    });
    render(sample);
  }

  /* --- job page: live progress and logs (polls once a second) ------------ */
  function drawMetrics(tables) {
    // The job's metrics as tables (cloud_service/ui/jobs.py: metric_tables), never raw JSON.
    var box = document.getElementById("job-metrics");
    box.replaceChildren();
    if (!tables.length) {
      var none = document.createElement("p");
      none.className = "empty";
      none.textContent = "No metrics yet.";
      box.appendChild(none);
    }
    tables.forEach(function (t) {
      var table = document.createElement("table");
      table.className = "grid metrics";
      table.createCaption().textContent = t.title;
      var head = table.createTHead().insertRow();
      t.columns.forEach(function (c) {
        var th = document.createElement("th");
        th.textContent = c;
        head.appendChild(th);
      });
      var body = table.createTBody();
      t.rows.forEach(function (r) {
        var row = body.insertRow();
        r.forEach(function (v) { row.insertCell().textContent = v; });
      });
      box.appendChild(table);
    });
  }

  function jobPage() {
    var job = JSON.parse(document.getElementById("job-data").textContent);
    var last = job.logs.length ? job.logs[job.logs.length - 1].id : 0;
    var done = ["succeeded", "failed", "cancelled"];
    // The server drew these tables; draw them again only when they change, so a
    // poll never replaces what the reader is looking at with the same thing.
    function metricsKey(tables) {  // independent of the JSON's key order
      return JSON.stringify((tables || []).map(function (t) { return [t.title, t.columns, t.rows]; }));
    }
    var drawnMetrics = metricsKey(job.metric_tables);
    function draw(j) {
      var state = document.getElementById("job-state");
      state.textContent = j.state + (j.cancel_requested && j.state === "running" ? " (cancel requested)" : "");
      state.className = "status " + j.state;
      document.getElementById("job-progress").value = j.percent;
      document.getElementById("job-percent").textContent = j.percent + "%";
      document.getElementById("job-phase").textContent = j.phase || "—";
      document.getElementById("job-eta").textContent = j.eta_s === null ? "—" : Math.round(j.eta_s);
      document.getElementById("job-result").textContent = j.result_version || "—";
      if (j.metric_tables && metricsKey(j.metric_tables) !== drawnMetrics) {
        drawMetrics(j.metric_tables);
        drawnMetrics = metricsKey(j.metric_tables);
      }
      var waiting = document.getElementById("job-waiting");
      waiting.textContent = j.waiting || "";
      waiting.hidden = !j.waiting;
      document.getElementById("job-error").textContent = j.error || "";
      document.getElementById("cancel-job").disabled = done.indexOf(j.state) >= 0 || j.cancel_requested;
      var log = document.getElementById("job-log");
      j.logs.forEach(function (line) {
        var span = document.createElement("span");
        span.dataset.id = line.id;
        span.textContent = line.at + " " + line.level + " " + line.message + "\n";
        log.appendChild(span);
        last = Math.max(last, line.id);
      });
      if (j.logs.length) log.scrollTop = log.scrollHeight;
    }
    function poll() {
      api("GET", "/ui/api/jobs/" + job.id + "?after=" + last).then(function (j) {
        draw(j);
        if (done.indexOf(j.state) < 0) setTimeout(poll, 1000);
      }).catch(function () { setTimeout(poll, 3000); });
    }
    document.getElementById("cancel-job").addEventListener("click", function () {
      api("POST", "/ui/api/jobs/" + job.id + "/cancel", {}).then(draw).catch(function (e) {
        document.getElementById("job-error").textContent = e.message;
      });
    });
    poll();
  }

  /* --- every page: "Back" links go back in the history where there is one --- */
  Array.prototype.forEach.call(document.querySelectorAll("a[data-back=history]"), function (link) {
    link.addEventListener("click", function (event) {
      if (window.history.length > 1) { event.preventDefault(); window.history.back(); }
    });
  });

  // A form with data-confirm asks before it submits (the page's policy allows no inline handlers).
  document.addEventListener("submit", function (e) {
    var message = e.target.dataset ? e.target.dataset.confirm : null;
    if (message && !window.confirm(message)) e.preventDefault();
  });

  return { api: api, jobPage: jobPage, queuePage: queuePage, reviewPage: reviewPage };
})();
