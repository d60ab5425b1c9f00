/**
 * GET /healthz for edgepg-proxy: opens a TCP connection to the upstream Postgres and closes it
 * (no startup, no login: nothing shows up in Postgres's logs beyond a dropped connection), and
 * answers JSON:
 *
 *   200 {"status":"ok","upstream":"127.0.0.1:5432","latencyMs":0.42}
 *   503 {"status":"unavailable","upstream":"127.0.0.1:5432","error":"ECONNREFUSED","latencyMs":0.3}
 *   503 {"status":"draining","upstream":"127.0.0.1:5432"} (shutting down: a balancer sends no one new)
 *
 * It never takes longer than `timeoutMs` (the error is then "ETIMEDOUT"), and Postgres is probed at
 * most once a second (see healthHandler).
 */
import net from 'node:net'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { formatHostPort, type HostPort } from '../upstream/address'

export interface HealthResult {
  status: 'ok' | 'unavailable' | 'draining'
  upstream: string
  latencyMs?: number
  error?: string
}

/** One reachability check of `upstream`, settled within `timeoutMs`. */
export function checkUpstream(upstream: HostPort, timeoutMs = 2000): Promise<HealthResult> {
  const name = formatHostPort(upstream)
  const started = process.hrtime.bigint()
  const elapsed = () => Math.round(Number(process.hrtime.bigint() - started) / 1e4) / 100 // ms, 2 decimals
  return new Promise((resolve) => {
    let done = false
    const socket = net.connect({ host: upstream.host, port: upstream.port })
    const finish = (error?: string) => {
      if (done) return
      done = true
      clearTimeout(timer)
      socket.destroy()
      resolve(error === undefined ? { status: 'ok', upstream: name, latencyMs: elapsed() } : { status: 'unavailable', upstream: name, error, latencyMs: elapsed() })
    }
    const timer = setTimeout(() => finish('ETIMEDOUT'), timeoutMs)
    socket.once('connect', () => finish())
    socket.on('error', (err: NodeJS.ErrnoException) => finish(err.code ?? err.message))
  })
}

/**
 * An HTTP handler for GET/HEAD /healthz. Postgres is probed at most once per `probeEveryMs`, however
 * often it is asked: requests meanwhile share the last probe (a stranger's flood of /healthz costs
 * Postgres one connection a second). Once `draining()`, the answer is 503 without a probe.
 */
export function healthHandler(upstream: HostPort, { draining = (): boolean => false, timeoutMs = 2000, probeEveryMs = 1000 } = {}) {
  let probe: Promise<HealthResult> | undefined
  let probedAt = -Infinity
  /** `named`: the answer names the upstream (not on the public listener, where it would tell anyone). */
  return (req: IncomingMessage, res: ServerResponse, named = true): void => {
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      res.writeHead(405, { allow: 'GET, HEAD', 'content-type': 'text/plain' })
      res.end('method not allowed\n')
      return
    }
    const told = ({ upstream, ...rest }: HealthResult) => (named ? { upstream, ...rest } : rest)
    if (draining()) return answer(req, res, told({ status: 'draining', upstream: formatHostPort(upstream) }))
    if (performance.now() - probedAt >= probeEveryMs) {
      probedAt = performance.now()
      probe = checkUpstream(upstream, timeoutMs)
    }
    probe!.then((result) => answer(req, res, told(result)))
  }
}

function answer(req: IncomingMessage, res: ServerResponse, result: Omit<HealthResult, 'upstream'>) {
  if (res.destroyed || res.writableEnded) return // the caller gave up
  res.writeHead(result.status === 'ok' ? 200 : 503, { 'content-type': 'application/json', 'cache-control': 'no-store' })
  res.end(req.method === 'HEAD' ? undefined : JSON.stringify(result) + '\n')
}
