/**
 * The demo's injected network delay, done for real on the server side: WebSocket upgrades and
 * `/sql` requests to the console's server are passed on to edgepg-proxy with every chunk held
 * `oneWayMs` in each direction (RTT = 2 × oneWayMs), as test/support/delay-relay.ts does for raw TCP.
 * The upgrade itself is delayed too, so opening a WebSocket costs one RTT, as over a real network.
 */
import http, { type IncomingMessage, type ServerResponse } from 'node:http'
import net from 'node:net'
import type { Duplex } from 'node:stream'

export interface Target {
  host: string
  port: number
}

/** Runs `fn` after `ms`, or at once when there is no delay (a 0 ms timer still costs a tick). */
const later = (ms: number, fn: () => void) => (ms > 0 ? void setTimeout(fn, ms) : fn())

/** Forwards bytes from `from` to `to`, each chunk (and the end) `oneWayMs` late, in order. */
function pipeDelayed(from: Duplex, to: Duplex, oneWayMs: number) {
  from.on('data', (chunk: Buffer) => later(oneWayMs, () => to.writable && to.write(chunk)))
  from.on('end', () => later(oneWayMs, () => to.end()))
  from.on('error', () => later(oneWayMs, () => to.destroy()))
  from.on('close', () => later(oneWayMs && oneWayMs + 1, () => to.destroy()))
}

/**
 * Relays a WebSocket upgrade to `path` on the proxy as raw bytes: the request head (headers
 * as the browser sent them, Origin included, so the proxy's origin check applies), then both
 * directions. `sockets` collects both ends, for shutdown.
 */
export function relayUpgrade(req: IncomingMessage, client: Duplex, head: Buffer, target: Target, path: string, oneWayMs: number, sockets: Set<Duplex>) {
  const upstream = net.connect({ ...target, noDelay: true })
  for (const s of [client, upstream]) {
    sockets.add(s)
    s.once('close', () => sockets.delete(s))
  }
  if (client instanceof net.Socket) client.setNoDelay(true)
  const lines = [`${req.method} ${path} HTTP/1.1`]
  for (let i = 0; i < req.rawHeaders.length; i += 2) lines.push(`${req.rawHeaders[i]}: ${req.rawHeaders[i + 1]}`)
  const request = Buffer.concat([Buffer.from(lines.join('\r\n') + '\r\n\r\n', 'latin1'), head])
  later(oneWayMs, () => upstream.writable && upstream.write(request))
  pipeDelayed(client, upstream, oneWayMs)
  pipeDelayed(upstream, client, oneWayMs)
}

const agent = new http.Agent({ keepAlive: true })

/** Relays one HTTP request to `path` on the proxy: the request held `oneWayMs`, then the response. */
export async function relayRequest(req: IncomingMessage, res: ServerResponse, target: Target, path: string, oneWayMs: number) {
  const body = await readAll(req)
  await sleep(oneWayMs)
  const headers = { ...req.headers }
  delete headers.connection
  try {
    const reply = await new Promise<{ status: number; headers: http.IncomingHttpHeaders; body: Buffer }>((resolve, reject) => {
      const out = http.request({ ...target, path, method: req.method, headers, agent }, (r) =>
        readAll(r).then((b) => resolve({ status: r.statusCode ?? 502, headers: r.headers, body: b }), reject)
      )
      out.once('error', reject)
      out.end(body)
    })
    await sleep(oneWayMs)
    delete reply.headers.connection
    delete reply.headers['keep-alive']
    delete reply.headers['transfer-encoding']
    res.writeHead(reply.status, { ...reply.headers, 'content-length': reply.body.length })
    res.end(reply.body)
  } catch (err) {
    await sleep(oneWayMs)
    res.writeHead(502, { 'content-type': 'text/plain' }).end(`demo relay: edgepg-proxy unreachable: ${(err as Error).message}\n`)
  }
}

const sleep = (ms: number) => new Promise<void>((r) => (ms > 0 ? setTimeout(r, ms) : r()))

function readAll(stream: NodeJS.ReadableStream): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = []
    stream.on('data', (c: Buffer) => chunks.push(c))
    stream.once('end', () => resolve(Buffer.concat(chunks)))
    stream.once('error', reject)
  })
}

/** Stops the keep-alive connections to the proxy. */
export const closeRelays = () => agent.destroy()
