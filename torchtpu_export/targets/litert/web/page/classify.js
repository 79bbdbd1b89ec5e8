// Image classification: an image drawn to a canvas becomes the model's float32 input, in NHWC
// (the canvas's own order: rows of RGB pixels) or, for a model that takes NCHW, transposed here.
import {initLiteRt, loadModel, median, runModel, runtime, toBase64} from './litert_runner.js';

const $ = (id) => document.getElementById(id);
const MEAN = [0.485, 0.456, 0.406];
const STD = [0.229, 0.224, 0.225];
const NORMS = {
  imagenet: (v, c) => (v / 255 - MEAN[c]) / STD[c],
  unit: (v) => v / 255,
  signed: (v) => v / 127.5 - 1,
};

let current = null;  // loadModel() result
let labels = null;   // class names from /labels.json, if served

/** Where the channels are in a model's image input: {layout: 'NHWC' | 'NCHW', height, width}. */
export function imageLayout(inp) {
  const s = inp.shape;
  if (inp.dtype !== 'float32' || s.length !== 4 || s[0] !== 1) {
    throw new Error(`input ${inp.name} is ${inp.dtype}[${s}]; an image input is float32 [1, H, W, 3] or [1, 3, H, W]`);
  }
  if (s[3] === 3) return {layout: 'NHWC', height: s[1], width: s[2]};
  if (s[1] === 3) return {layout: 'NCHW', height: s[2], width: s[3]};
  throw new Error(`input ${inp.name} [${s}] has no dimension of 3 colour channels`);
}

/** The canvas's RGB pixels as a normalised float32 tensor in the given layout. */
export function canvasToTensor(ctx, width, height, layout, norm) {
  const rgba = ctx.getImageData(0, 0, width, height).data;
  const f = NORMS[norm];
  const out = new Float32Array(width * height * 3);
  const plane = width * height;
  for (let p = 0; p < plane; p++) {
    for (let c = 0; c < 3; c++) {
      out[layout === 'NHWC' ? p * 3 + c : c * plane + p] = f(rgba[p * 4 + c], c);
    }
  }
  return {data: out, rgba};
}

/** A picture made in code (the demo downloads nothing): sky, sun, hills and a house. */
function drawSample(ctx, w, h) {
  const sky = ctx.createLinearGradient(0, 0, 0, h);
  sky.addColorStop(0, '#3d7fd9');
  sky.addColorStop(1, '#cfe6ff');
  ctx.fillStyle = sky;
  ctx.fillRect(0, 0, w, h);
  ctx.fillStyle = '#ffd23f';
  ctx.beginPath();
  ctx.arc(w * 0.78, h * 0.22, w * 0.1, 0, 2 * Math.PI);
  ctx.fill();
  ctx.fillStyle = '#3f8f3a';
  ctx.beginPath();
  ctx.ellipse(w * 0.3, h * 1.05, w * 0.6, h * 0.4, 0, 0, 2 * Math.PI);
  ctx.fill();
  ctx.fillStyle = '#b8412c';
  ctx.fillRect(w * 0.45, h * 0.5, w * 0.3, h * 0.25);
  ctx.fillStyle = '#5a2a1a';
  ctx.beginPath();
  ctx.moveTo(w * 0.42, h * 0.5);
  ctx.lineTo(w * 0.6, h * 0.36);
  ctx.lineTo(w * 0.78, h * 0.5);
  ctx.fill();
}

/** Draws an image centre-cropped to a square and scaled to the canvas. */
function drawImage(ctx, img, w, h) {
  const side = Math.min(img.naturalWidth, img.naturalHeight);
  ctx.drawImage(img, (img.naturalWidth - side) / 2, (img.naturalHeight - side) / 2, side, side, 0, 0, w, h);
}

function softmax(logits) {
  const m = Math.max(...logits);
  const e = Array.from(logits, (v) => Math.exp(v - m));
  const s = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / s);
}

function setStatus(text, error = false) {
  $('status').textContent = text;
  $('status').className = error ? 'error' : '';
}

function imageInput() {
  const spec = current.signatures[current.defaultSignature];
  if (spec.inputs.length !== 1) throw new Error(`the model takes ${spec.inputs.length} inputs; an image classifier takes one`);
  return {spec, inp: spec.inputs[0], ...imageLayout(spec.inputs[0])};
}

async function useModel(url, accelerator = null) {
  current = await loadModel(url, accelerator);
  const {inp, layout, height, width} = imageInput();
  const canvas = $('canvas');
  canvas.width = width;
  canvas.height = height;
  drawSample(canvas.getContext('2d', {willReadFrequently: true}), width, height);
  $('model-info').textContent = `${url}: input ${inp.name} float32 [${inp.shape}] (${layout}` +
      (layout === 'NCHW' ? ', transposed from the canvas in JS' : '') + `), on ${current.accelerator.where}`;
  $('run').disabled = false;
  setStatus(`compiled in ${current.timings.compileMs.toFixed(1)} ms (${current.accelerator.text})`);
}

async function classify({norm = $('norm').value, repeats = 5} = {}) {
  const {spec, inp, layout, height, width} = imageInput();
  const ctx = $('canvas').getContext('2d', {willReadFrequently: true});
  const t0 = performance.now();
  const {data, rgba} = canvasToTensor(ctx, width, height, layout, norm);
  const prepMs = performance.now() - t0;
  const result = await runModel(current, {[inp.name]: {dtype: 'float32', shape: inp.shape, data}}, {repeats});
  const outName = spec.outputs[0].name;
  const logits = result.outputs[outName].data;
  const probs = softmax(logits);
  const top = Array.from(probs.keys()).sort((a, b) => probs[b] - probs[a]).slice(0, 5)
      .map((i) => ({index: i, label: labels?.[i] ?? `class ${i}`, probability: probs[i]}));
  const timings = {prepMs, firstRunMs: result.firstRunMs, medianRunMs: median(result.runMs),
                   compileMs: current.timings.compileMs, threads: current.threads};
  const body = $('top').querySelector('tbody');
  body.replaceChildren(...top.map((t, k) => {
    const tr = document.createElement('tr');
    for (const v of [k + 1, t.label, t.probability.toFixed(4)]) tr.append(Object.assign(document.createElement('td'), {textContent: v}));
    return tr;
  }));
  $('timings').querySelector('tbody').replaceChildren(...Object.entries({
    'canvas → tensor': prepMs, [`compile (${current.accelerator.used})`]: timings.compileMs,
    'first run': timings.firstRunMs,
    [`median of ${repeats} runs`]: timings.medianRunMs,
  }).map(([k, v]) => {
    const tr = document.createElement('tr');
    tr.append(Object.assign(document.createElement('td'), {textContent: k}),
              Object.assign(document.createElement('td'), {textContent: Number.isFinite(v) ? `${v.toFixed(2)} ms` : '–'}));
    return tr;
  }));
  setStatus(`top-1: ${top[0].label} (${(100 * top[0].probability).toFixed(1)}%) on ${current.accelerator.where}`);
  return {accelerator: {...current.accelerator, threads: current.threads}, layout, inputName: inp.name,
          inputShape: inp.shape, outputName: outName, width, height, norm,
          rgba: toBase64(rgba), input: toBase64(data), logits: toBase64(logits), top, timings};
}

window.tte = {
  /** Loads a model (default: the one the page shows) for an accelerator (default: the page's choice,
   *  ?accelerator=), draws the sample picture and classifies it. */
  async classify({model = null, accelerator = null, norm = 'imagenet', repeats = 5} = {}) {
    await started.catch(() => {});  // the page's own first load and run come first
    const acc = accelerator ?? runtime.accelerator;
    if ((model && model !== current?.url) || (current && acc !== current.accelerator.requested)) {
      await useModel(model ?? current.url, acc);
    }
    return classify({norm, repeats});
  },
};

async function main() {
  await initLiteRt();
  const labelsResponse = await fetch('/labels.json');
  labels = labelsResponse.ok ? await labelsResponse.json() : null;
  $('file').addEventListener('change', () => {
    const img = new Image();
    img.onload = () => {
      drawImage($('canvas').getContext('2d', {willReadFrequently: true}), img, $('canvas').width, $('canvas').height);
      URL.revokeObjectURL(img.src);
      classify().catch((e) => setStatus(String(e.message ?? e), true));
    };
    img.onerror = () => setStatus('that file is not an image the browser can decode', true);
    img.src = URL.createObjectURL($('file').files[0]);
  });
  $('sample').addEventListener('click', () => {
    drawSample($('canvas').getContext('2d', {willReadFrequently: true}), $('canvas').width, $('canvas').height);
    classify().catch((e) => setStatus(String(e.message ?? e), true));
  });
  $('run').addEventListener('click', () => classify().catch((e) => setStatus(String(e.message ?? e), true)));
  window.tteReady = true;
  await useModel(new URLSearchParams(location.search).get('model') ?? '/model.tflite');
  await classify();
}

const started = main();
started.catch((e) => {
  window.tteReady = true;
  setStatus(String(e.message ?? e), true);
});
