// Draws recorded runs as waterfalls: one row per flight (consecutive frames in one direction),
// bars on a time axis shared by all runs shown, so runs compare at a glance.
import { collapse } from './wire.js'

/**
 * Groups a run's events into flights and counts its round trips: opening the WebSocket (the HTTP
 * upgrade) is one, and so is every flight out that a flight back answers.
 */
export function flightsOf(events) {
  const flights = []
  for (const e of events) {
    const last = flights[flights.length - 1]
    if (e.dir !== 'connect' && last?.dir === e.dir) {
      last.end = e.end
      last.bytes += e.bytes
      last.frames++
      last.names.push(...e.names)
    } else flights.push({ ...e, names: [...e.names], frames: e.dir === 'connect' ? 0 : 1 })
  }
  let roundTrips = 0
  flights.forEach((f, i) => {
    if (f.dir === 'connect' && !f.failed) f.roundTrip = ++roundTrips
    if (f.dir === 'out' && flights[i + 1]?.dir === 'in') {
      f.roundTrip = ++roundTrips
      f.answeredAt = flights[i + 1].start
    }
  })
  return { flights, roundTrips }
}

/** A round axis end and tick step for `ms`: steps of 1, 2 or 5 × 10ⁿ, at most 8 ticks. */
function axis(ms) {
  const max = Math.max(ms, 1)
  let step = 10 ** Math.floor(Math.log10(max))
  for (const m of [0.1, 0.2, 0.5, 1]) if (max / (step * m) <= 8) return { step: step * m, end: Math.ceil(max / (step * m)) * step * m }
  return { step, end: Math.ceil(max / step) * step }
}

const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag)
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'style') for (const [p, x] of Object.entries(v)) node.style.setProperty(p.replace(/[A-Z]/g, (c) => '-' + c.toLowerCase()), x)
    else if (k === 'dataset') Object.assign(node.dataset, v)
    else node.setAttribute(k, v)
  }
  node.append(...children.filter((c) => c !== undefined && c !== null))
  return node
}
const ms = (t) => (t === 0 ? '0' : t < 10 ? t.toFixed(1) : Math.round(t).toString())
const bytes = (n) => (n < 1024 ? `${n} B` : `${(n / 1024).toFixed(1)} kB`)
const ARROWS = { connect: '⇄', out: '→', in: '←' }

/** Replaces `container`'s content with `runs` (newest first), all on one time scale. */
export function renderRuns(container, runs) {
  const { step, end } = axis(Math.max(...runs.map((r) => r.duration), 0))
  container.replaceChildren(...runs.map((run) => renderRun(run, step, end)))
}

function renderRun(run, step, end) {
  const { flights, roundTrips } = flightsOf(run.events)
  const pct = (t) => `${(Math.min(t, end) / end) * 100}%`
  const afterOpen = roundTrips - flights.filter((f) => f.dir === 'connect' && !f.failed).length
  const ticks = []
  for (let t = 0; t <= end + 1e-9; t += step) ticks.push(el('span', { class: 'tick', style: { left: pct(t) } }, `${ms(t)} ms`))
  const outcome = run.error ? `error` : `${run.rowCount} row${run.rowCount === 1 ? '' : 's'}`

  const rows = flights.map((f) => {
    const names = collapse(f.names)
    const span = f.dir === 'out' && f.answeredAt !== undefined ? f.answeredAt - f.start : f.end - f.start
    const what = el(
      'div',
      { class: 'what', title: names.join(', ') },
      el('span', { class: 'arrow' }, ARROWS[f.dir]),
      f.roundTrip ? el('span', { class: 'rt', title: `round trip ${f.roundTrip}` }, String(f.roundTrip)) : el('span', { class: 'rt none' }),
      el(
        'span',
        { class: 'names' },
        f.dir === 'connect' ? names[0] : names.join(', '),
        f.dir === 'connect' ? undefined : el('span', { class: 'size' }, ` · ${bytes(f.bytes)}${f.frames > 1 ? ` in ${f.frames} frames` : ''}`)
      )
    )
    const track = el(
      'div',
      { class: 'track', style: { '--tick': pct(step) } },
      f.answeredAt !== undefined ? el('div', { class: 'wait', style: { left: pct(f.end), width: `calc(${pct(f.answeredAt)} - ${pct(f.end)})` } }) : undefined,
      el('div', { class: 'bar', style: { left: pct(f.start), width: `calc(${pct(f.end)} - ${pct(f.start)})` } })
    )
    return el(
      'div',
      {
        class: `flight ${f.dir}`,
        'data-flight': '',
        dataset: { dir: f.dir, startMs: f.start.toFixed(1), endMs: f.end.toFixed(1), messages: f.names.join(','), ...(f.roundTrip && { roundTrip: f.roundTrip }) },
      },
      what,
      track,
      el('div', { class: 'when', title: `starts at ${ms(f.start)} ms` }, `${ms(span)} ms`)
    )
  })

  return el(
    'section',
    {
      class: `run${run.error ? ' failed' : ''}`,
      'data-run': String(run.id),
      dataset: { transport: run.transport, rtt: run.rtt, roundTrips, afterOpen, durationMs: run.duration.toFixed(1) },
    },
    el(
      'header',
      {},
      el('span', { class: 'title' }, run.label),
      el('span', { class: 'meta' }, `RTT ${run.rtt} ms`),
      el('span', { class: 'meta' }, outcome),
      el('span', { class: 'total' }, el('b', {}, `${roundTrips} round trip${roundTrips === 1 ? '' : 's'}`), ` · ${ms(run.duration)} ms`)
    ),
    el('div', { class: 'axis' }, el('div'), el('div', { class: 'ticks' }, ...ticks), el('div')),
    ...rows
  )
}
