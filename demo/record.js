// Records one run's network traffic with timestamps: a WebSocket class to hand edgepg as
// `webSocketConstructor` (every frame sent and received, decoded into Postgres messages), and a
// `fetch` to hand `httpSql` (each request and its response). Times are ms since the recorder was made.
import { protocolReader } from './wire.js'

export function recorder() {
  const t0 = performance.now()
  const now = () => performance.now() - t0
  /** { dir: 'connect', start, end, failed? } | { dir: 'out'|'in', start, end, bytes, names } */
  const events = []
  let stoppedAt

  const push = (event) => stoppedAt === undefined && events.push(event)
  const view = (data) =>
    data instanceof ArrayBuffer ? new Uint8Array(data)
    : ArrayBuffer.isView(data) ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength)
    : new TextEncoder().encode(String(data))

  class RecordingWebSocket extends WebSocket {
    #sent = protocolReader('frontend')
    constructor(url, protocols) {
      const start = now()
      super(url, protocols)
      const received = protocolReader('backend')
      let opened = false
      // The login edgepg offers in the upgrade (a subprotocol value) is the upgrade's own flight.
      const login = [protocols].flat().find((p) => p?.startsWith('edgepg.login.'))
      const carried = login ? this.#sent(Uint8Array.from(atob(login.slice(13).replace(/-/g, '+').replace(/_/g, '/')), (c) => c.charCodeAt(0))) : []
      // Registered before edgepg's own listeners, so each frame is stamped before it is handled.
      this.addEventListener('open', () => {
        opened = true
        push({ dir: 'connect', start, end: now(), names: ['WebSocket upgrade', ...carried] })
      })
      this.addEventListener('close', () => opened || push({ dir: 'connect', start, end: now(), names: ['WebSocket upgrade (failed)'], failed: true }))
      this.addEventListener('message', (event) => {
        const bytes = view(event.data)
        const t = now()
        push({ dir: 'in', start: t, end: t, bytes: bytes.length, names: received(bytes) })
      })
    }
    send(data) {
      const bytes = view(data)
      const t = now()
      push({ dir: 'out', start: t, end: t, bytes: bytes.length, names: this.#sent(bytes) })
      return super.send(data)
    }
  }

  async function recordingFetch(input, init = {}) {
    const body = typeof init.body === 'string' ? new TextEncoder().encode(init.body) : view(init.body ?? '')
    push({ dir: 'out', start: now(), end: now(), bytes: body.length, names: [`${init.method ?? 'GET'} ${new URL(input, location.href).pathname}`] })
    const res = await fetch(input, init)
    const start = now() // response headers are in
    const payload = await res.arrayBuffer()
    let summary = ''
    try {
      const json = JSON.parse(new TextDecoder().decode(payload))
      summary = json.command ? `${json.command} ${json.rowCount ?? ''}`.trim() : json.message ? `error: ${json.code ?? ''}`.trim() : ''
    } catch {}
    push({ dir: 'in', start, end: now(), bytes: payload.byteLength, names: [`HTTP ${res.status}`, ...(summary ? [summary] : [])] })
    return new Response(payload, { status: res.status, statusText: res.statusText, headers: res.headers })
  }

  return {
    WebSocket: RecordingWebSocket,
    fetch: recordingFetch,
    events,
    /** Ends the recording (at the first result: closing the client is not part of the run). */
    stop() {
      stoppedAt ??= now()
      return stoppedAt
    },
  }
}
