/* EdgeLoop review UI: the box editor of detection samples.

   An SVG over the frame draws the edge's boxes (dashed orange), the teacher's (blue)
   and the reviewer's working label (green). Where edge and teacher agree their boxes
   are faint; a missed, extra, wrong-class or loose (localisation) box is strong, so
   only the differences catch the eye. The working label starts as the newest human
   label, else the teacher's boxes, else the edge's; every edit can be undone.
   Corners are fractions of the frame, as the server stores them. */
"use strict";
var EdgeLoopBoxes = (function () {
  var SVG = "http://www.w3.org/2000/svg";
  var MIN_DRAG_PX = 4;  // a shorter drag is a click: it selects the box under it
  var RING = 4;  // px between a label box and the ring drawn around it
  var HANDLE_PX = 8;  // how near a corner of the selected box a press resizes it
  var NUDGE = 0.01;  // an arrow key moves or resizes the selected box by this share of the frame
  var STATUS_TEXT = { missed: "missed", extra: "extra", wrong_class: "wrong class", localisation: "loose" };

  function make(name, attrs, parent) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attrs).forEach(function (key) { node.setAttribute(key, attrs[key]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function clamp01(v) { return Math.max(0, Math.min(1, v)); }
  function round(v) { return Math.round(v * 1e5) / 1e5; }
  function fromRow(row) { return { x1: row[0], y1: row[1], x2: row[2], y2: row[3], cls: row[row.length - 1] }; }
  function copy(list) { return list.map(function (b) { return { x1: b.x1, y1: b.y1, x2: b.x2, y2: b.y2, cls: b.cls }; }); }

  /* parts: img, svg, list (ol), select (class dropdown), summary, count, onEdit(text) */
  function editor(parts) {
    var sample = null;
    var work = [];
    var selected = -1;
    var history = [];
    var lastClass = 0;
    var drag = null;

    function className(cls) {
      return sample && cls < sample.classes.length ? sample.classes[cls] : String(cls);
    }

    function load(s) {
      sample = s;
      var start = s.label_boxes || s.teacher_boxes || s.edge_boxes || [];
      work = start.map(fromRow);
      selected = -1;
      history = [];
      drag = null;
      lastClass = work.length ? work[0].cls : 0;
      fillClasses();
      draw();
    }

    function boxes() {
      return work.map(function (b) { return [round(b.x1), round(b.y1), round(b.x2), round(b.y2), b.cls]; });
    }

    function remember() {
      history.push({ work: copy(work), selected: selected, lastClass: lastClass });
      if (history.length > 200) history.shift();
    }

    function edited(text) { draw(); if (parts.onEdit) parts.onEdit(text); return true; }

    function replace(rows, what) {
      if (!sample || rows === null || rows === undefined) return false;
      remember();
      work = rows.map(fromRow);
      selected = -1;
      return edited(what);
    }

    function acceptTeacher() {
      if (!sample || !sample.teacher_boxes) { if (parts.onEdit) parts.onEdit("The teacher has not answered yet."); return false; }
      return replace(sample.teacher_boxes, "Took the teacher's " + sample.teacher_boxes.length + " boxes.");
    }

    function acceptEdge() { return replace(sample ? sample.edge_boxes : null, "Took the edge's " + (sample ? sample.edge_boxes.length : 0) + " boxes."); }

    function select(step) {
      if (!work.length) return false;
      if (selected < 0) selected = step > 0 ? 0 : work.length - 1;
      else selected = (selected + step + work.length) % work.length;
      draw();
      return true;
    }

    function deleteSelected() {
      if (selected < 0) return false;
      remember();
      var gone = work.splice(selected, 1)[0];
      selected = work.length ? Math.min(selected, work.length - 1) : -1;
      return edited("Deleted a " + className(gone.cls) + " box.");
    }

    function setClass(cls) {
      if (!sample || cls < 0 || cls >= sample.classes.length) return false;
      if (selected < 0) {
        lastClass = cls;
        draw();
        if (parts.onEdit) parts.onEdit("No box selected: boxes drawn next are " + className(cls) + ".");
        return true;
      }
      if (work[selected].cls === cls) return true;
      remember();
      work[selected].cls = cls;
      lastClass = cls;
      return edited("Class " + className(cls) + ".");
    }

    function addBox(x1, y1, x2, y2) {
      remember();
      work.push({ x1: x1, y1: y1, x2: x2, y2: y2, cls: lastClass });
      selected = work.length - 1;
      return edited("Drew a " + className(lastClass) + " box.");
    }

    function undo() {
      var last = history.pop();
      if (!last) return false;
      work = last.work; selected = last.selected; lastClass = last.lastClass;
      edited("Edit undone.");
      return true;
    }

    /* --- drawing ------------------------------------------------------------ */
    function size() {
      return { w: parts.img.clientWidth || 1, h: parts.img.clientHeight || 1 };
    }

    function label(group, text, x, y, anchor, kind) {
      var t = make("text", { x: x, y: y, "text-anchor": anchor, "class": "box-label " + kind }, group);
      t.textContent = text;
    }

    function drawLayer(rows, layer, statuses, wh) {
      (rows || []).forEach(function (row, i) {
        var status = statuses ? statuses[i] : "unjudged";
        var strong = status !== "matched";
        var b = fromRow(row);
        var g = make("g", { "class": "layer-" + layer }, parts.svg);
        var rect = make("rect", {
          x: b.x1 * wh.w, y: b.y1 * wh.h, width: (b.x2 - b.x1) * wh.w, height: (b.y2 - b.y1) * wh.h,
          "class": "box " + layer + " " + (strong ? "strong " : "faint ") + status,
          "data-layer": layer, "data-index": i, "data-status": status, "data-class": b.cls
        }, g);
        rect.setAttribute("aria-label", layer + " box " + className(b.cls) + " " + status);
        var text = (layer === "edge" ? "E " : "T ") + className(b.cls);
        if (layer === "edge" && row.length > 5) text += " " + Number(row[4]).toFixed(2);
        if (strong && STATUS_TEXT[status]) text += " · " + STATUS_TEXT[status];
        var kind = (strong ? "strong " : "faint ") + layer;
        if (layer === "teacher") {  // above the box, at its left (inside when at the top)
          var top = b.y1 * wh.h;
          label(g, text, b.x1 * wh.w + 1, top < 14 ? top + 12 : top - 3, "start", kind);
        } else {  // under the box, at its right (inside when at the bottom)
          var bottom = b.y2 * wh.h;
          label(g, text, b.x2 * wh.w - 1, bottom > wh.h - 14 ? bottom - 4 : bottom + 12, "end", kind);
        }
      });
    }

    function draw() {
      var svg = parts.svg;
      var wh = size();
      svg.setAttribute("width", wh.w);
      svg.setAttribute("height", wh.h);
      svg.setAttribute("viewBox", "0 0 " + wh.w + " " + wh.h);
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      if (!sample) return;
      var diff = sample.differences;
      drawLayer(sample.teacher_boxes, "teacher", diff ? diff.teacher : null, wh);
      drawLayer(sample.edge_boxes, "edge", diff ? diff.edge : null, wh);
      work.forEach(function (b, i) {
        // A ring just outside the box, so the teacher's and the edge's strokes stay visible.
        var g = make("g", { "class": "layer-work" }, svg);
        var rect = make("rect", {
          x: b.x1 * wh.w - RING, y: b.y1 * wh.h - RING,
          width: (b.x2 - b.x1) * wh.w + 2 * RING, height: (b.y2 - b.y1) * wh.h + 2 * RING,
          "class": "box work" + (i === selected ? " selected" : ""),
          "data-layer": "work", "data-index": i, "data-class": b.cls
        }, g);
        rect.setAttribute("aria-label", "label box " + className(b.cls));
        var t = make("text", { x: b.x1 * wh.w + 3, y: b.y2 * wh.h - 5, "class": "box-label work" + (i === selected ? " selected" : "") }, g);
        t.textContent = className(b.cls);
        if (i === selected) {  // the corners a drag resizes
          [[b.x1, b.y1, -1, -1], [b.x2, b.y1, 1, -1], [b.x1, b.y2, -1, 1], [b.x2, b.y2, 1, 1]].forEach(function (c) {
            var x = c[0] * wh.w + c[2] * RING, y = c[1] * wh.h + c[3] * RING;  // on the ring
            make("rect", { x: x - 4, y: y - 4, width: 8, height: 8, "class": "handle" }, g);
          });
        }
      });
      if (drag && drag.moved) {
        make("rect", {
          x: Math.min(drag.x0, drag.x1) * wh.w, y: Math.min(drag.y0, drag.y1) * wh.h,
          width: Math.abs(drag.x1 - drag.x0) * wh.w, height: Math.abs(drag.y1 - drag.y0) * wh.h,
          "class": "box drawing"
        }, svg);
      }
      svg.dataset.work = JSON.stringify(boxes());
      svg.dataset.selected = String(selected);
      svg.dataset.edits = String(history.length);
      drawPanel();
    }

    function fillClasses() {
      var select = parts.select;
      select.textContent = "";
      sample.classes.forEach(function (name, i) {
        var option = document.createElement("option");
        option.value = String(i);
        option.textContent = name === String(i) ? name : (i < 10 ? i + " · " : "") + name;
        select.appendChild(option);
      });
    }

    function drawPanel() {
      parts.select.value = String(selected >= 0 ? work[selected].cls : lastClass);
      parts.count.textContent = work.length + (work.length === 1 ? " box" : " boxes") +
        (selected >= 0 ? " · box " + (selected + 1) + " selected" : "");
      var list = parts.list;
      list.textContent = "";
      work.forEach(function (b, i) {
        var li = document.createElement("li");
        li.className = i === selected ? "selected" : "";
        li.dataset.index = String(i);
        var name = document.createElement("b"); name.textContent = className(b.cls);
        li.appendChild(name);
        li.appendChild(document.createTextNode(" (" + b.x1.toFixed(2) + ", " + b.y1.toFixed(2) + ") – (" + b.x2.toFixed(2) + ", " + b.y2.toFixed(2) + ")"));
        li.addEventListener("click", function () { selected = i; draw(); });
        list.appendChild(li);
      });
    }

    /* --- mouse: a drag on a box moves it, on a selected box's corner resizes it,
       elsewhere (or with Shift) draws a new box; a click selects ------------------ */
    function point(event) {
      var r = parts.svg.getBoundingClientRect();
      return { x: clamp01((event.clientX - r.left) / (r.width || 1)), y: clamp01((event.clientY - r.top) / (r.height || 1)), r: r };
    }

    function boxAt(p) {  // the smallest working box under a point, else -1
      var hit = -1, area = Infinity;
      work.forEach(function (b, i) {
        var a = (b.x2 - b.x1) * (b.y2 - b.y1);
        if (p.x >= b.x1 && p.x <= b.x2 && p.y >= b.y1 && p.y <= b.y2 && a < area) { hit = i; area = a; }
      });
      return hit;
    }

    function cornerAt(p) {  // which corner of the selected box is within HANDLE_PX, else null
      if (selected < 0) return null;
      var b = work[selected], w = p.r.width || 1, h = p.r.height || 1, found = null;
      [["x1", "y1"], ["x2", "y1"], ["x1", "y2"], ["x2", "y2"]].forEach(function (c) {
        if (!found && Math.abs(b[c[0]] - p.x) * w <= HANDLE_PX && Math.abs(b[c[1]] - p.y) * h <= HANDLE_PX) found = c;
      });
      return found;
    }

    function tidy(b) {  // corners ordered and inside the frame, at least a pixel apart
      var x1 = clamp01(Math.min(b.x1, b.x2)), x2 = clamp01(Math.max(b.x1, b.x2));
      var y1 = clamp01(Math.min(b.y1, b.y2)), y2 = clamp01(Math.max(b.y1, b.y2));
      var w = size();
      if ((x2 - x1) * w.w < 1) x2 = Math.min(1, x1 + 1 / w.w);
      if ((y2 - y1) * w.h < 1) y2 = Math.min(1, y1 + 1 / w.h);
      b.x1 = x1; b.x2 = x2; b.y1 = y1; b.y2 = y2;
    }

    parts.svg.addEventListener("mousedown", function (event) {
      if (!sample || event.button !== 0) return;
      event.preventDefault();
      var p = point(event);
      var base = { x0: p.x, y0: p.y, x1: p.x, y1: p.y, moved: false, w: p.r.width, h: p.r.height };
      var corner = event.shiftKey ? null : cornerAt(p);
      var hit = event.shiftKey || corner ? -1 : boxAt(p);
      if (corner) base.mode = "resize", base.corner = corner, base.index = selected;
      else if (hit >= 0) base.mode = "move", base.index = hit;
      else base.mode = "draw";
      if (base.mode !== "draw") { selected = base.index; base.start = copy([work[base.index]])[0]; draw(); }
      drag = base;
    });
    document.addEventListener("mousemove", function (event) {
      if (!drag) return;
      var p = point(event);
      drag.x1 = p.x; drag.y1 = p.y;
      var far = Math.abs(drag.x1 - drag.x0) * drag.w >= MIN_DRAG_PX || Math.abs(drag.y1 - drag.y0) * drag.h >= MIN_DRAG_PX;
      if (drag.mode === "draw") {
        drag.moved = Math.abs(drag.x1 - drag.x0) * drag.w >= MIN_DRAG_PX && Math.abs(drag.y1 - drag.y0) * drag.h >= MIN_DRAG_PX;
      } else if (far || drag.moved) {
        if (!drag.moved) { remember(); drag.moved = true; }  // the box as it was, for undo
        var b = work[drag.index], s0 = drag.start;
        if (drag.mode === "move") {
          var dx = Math.max(-s0.x1, Math.min(1 - s0.x2, drag.x1 - drag.x0));
          var dy = Math.max(-s0.y1, Math.min(1 - s0.y2, drag.y1 - drag.y0));
          b.x1 = s0.x1 + dx; b.x2 = s0.x2 + dx; b.y1 = s0.y1 + dy; b.y2 = s0.y2 + dy;
        } else {
          b[drag.corner[0]] = p.x; b[drag.corner[1]] = p.y;
        }
      }
      draw();
    });
    document.addEventListener("mouseup", function (event) {
      if (!drag) return;
      var d = drag;
      drag = null;
      var p = point(event);
      d.x1 = p.x; d.y1 = p.y;
      if (d.mode === "move" || d.mode === "resize") {
        if (!d.moved) { draw(); return; }  // a click on a box: it is selected
        tidy(work[d.index]);
        edited((d.mode === "move" ? "Moved" : "Resized") + " a " + className(work[d.index].cls) + " box.");
        return;
      }
      var wide = Math.abs(d.x1 - d.x0) * d.w >= MIN_DRAG_PX && Math.abs(d.y1 - d.y0) * d.h >= MIN_DRAG_PX;
      if (wide) { addBox(Math.min(d.x0, d.x1), Math.min(d.y0, d.y1), Math.max(d.x0, d.x1), Math.max(d.y0, d.y1)); return; }
      selected = boxAt(p);  // a click beside every box: none selected
      draw();
    });

    /* --- keys: arrows move the selected box, Shift+arrows resize it ------------- */
    function nudge(dx, dy, resize) {
      if (selected < 0) return false;
      remember();
      var b = work[selected];
      if (resize) { b.x2 += dx; b.y2 += dy; }
      else {
        dx = Math.max(-b.x1, Math.min(1 - b.x2, dx)); dy = Math.max(-b.y1, Math.min(1 - b.y2, dy));
        b.x1 += dx; b.x2 += dx; b.y1 += dy; b.y2 += dy;
      }
      tidy(b);
      return edited((resize ? "Resized" : "Moved") + " a " + className(b.cls) + " box.");
    }

    function deselect() {
      if (selected < 0) return false;
      selected = -1;
      draw();
      return true;
    }

    parts.select.addEventListener("change", function () {
      setClass(Number(parts.select.value));
      parts.select.blur();  // the keys belong to the page again
    });
    parts.img.addEventListener("load", draw);
    window.addEventListener("resize", draw);

    return {
      load: load, boxes: boxes, draw: draw, acceptTeacher: acceptTeacher, acceptEdge: acceptEdge,
      select: select, deleteSelected: deleteSelected, setClass: setClass, addBox: addBox, undo: undo,
      nudge: nudge, deselect: deselect, step: NUDGE,
      hasSelection: function () { return selected >= 0; },
      canUndo: function () { return history.length > 0; }
    };
  }

  /* One line on what differs between edge and teacher. */
  function summary(sample) {
    var d = sample.differences;
    if (!d) return "The teacher has not answered yet.";
    if (!d.kinds.length) return "Edge and teacher agree on every box.";
    var counts = {};
    d.teacher.concat(d.edge.filter(function (s) { return s === "extra"; })).forEach(function (s) {
      if (s !== "matched") counts[s] = (counts[s] || 0) + 1;
    });
    return "Differences: " + Object.keys(STATUS_TEXT).filter(function (k) { return counts[k]; }).map(function (k) {
      return counts[k] + " " + STATUS_TEXT[k];
    }).join(", ") + ".";
  }

  return { editor: editor, summary: summary };
})();
