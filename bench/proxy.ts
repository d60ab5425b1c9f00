/**
 * The relays the benchmarks go through. edgepg-proxy runs by default as a child process
 * (`node dist/cli.mjs`, the built CLI), as it does in reality, so its relaying does not share the
 * measuring process's event loop and CPU; `--proxy=in-process` uses createProxy() directly.
 * A bare TCP relay child (bench/tcp-relay.ts) gives the cost of the extra hop alone.
 */
import { spawn, type ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { createProxy } from '../proxy/index'
import { freePort } from '../test/support/stack'
import { cpuSecondsOf, stopChild } from '../test/support/child-proxy'
import type { ProxyMode } from './lib'

export interface RunningProxy {
  port: number
  url: string
  mode: ProxyMode
  stop(): Promise<void>
}

export interface RunningRelay {
  port: number
  /** The child's CPU time so far (user + system), in seconds. */
  cpuSeconds(): number
  stop(): Promise<void>
}

const root = fileURLToPath(new URL('..', import.meta.url))

/** Children still running, killed synchronously if this process exits without stopping them. */
const live = new Set<ChildProcess>()
process.on('exit', () => {
  for (const child of live) child.kill('SIGKILL')
})

export interface ProxyStartOptions {
  /** false: relay the startup untouched, like a plain wsproxy (clients do md5/SCRAM themselves). */
  authOffload?: boolean
  /** false: no warm backends (--no-pool). */
  pool?: boolean
  /** More CLI flags (child mode only). */
  flags?: string[]
}

export async function startProxy(upstream: string, mode: 'child', options?: ProxyStartOptions): Promise<RunningProxy & RunningRelay>
export async function startProxy(upstream: string, mode: ProxyMode, options?: ProxyStartOptions): Promise<RunningProxy>
export async function startProxy(upstream: string, mode: ProxyMode, options: ProxyStartOptions = {}): Promise<RunningProxy> {
  if (mode === 'in-process') {
    const proxy = createProxy({ upstream, authOffload: options.authOffload, pool: { enabled: options.pool !== false } })
    const { port } = await proxy.listen(0, '127.0.0.1')
    return { port, url: `ws://127.0.0.1:${port}/v2`, mode, stop: () => proxy.close() }
  }
  // The CLI refuses port 0, so pick a free port here (a tiny race, harmless on a bench machine).
  const listen = `127.0.0.1:${await freePort()}`
  const flags = [...(options.authOffload === false ? ['--no-auth-offload'] : []), ...(options.pool === false ? ['--no-pool'] : []), ...(options.flags ?? [])]
  // As deployed: the built CLI (npm run bench builds first), not the TypeScript under tsx.
  const child = await startChild(['dist/cli.mjs', '--upstream', upstream, '--listen', listen, ...flags], 'edgepg-proxy')
  return { ...child, url: `ws://127.0.0.1:${child.port}/v2`, mode }
}

export function startTcpRelay(upstream: string): Promise<RunningRelay> {
  return startChild(['bench/tcp-relay.ts', upstream], 'tcp relay')
}

/** A bare WebSocket-to-TCP relay (bench/ws-relay.ts): the floor for a warm query over a WebSocket. */
export function startWsRelay(upstream: string): Promise<RunningRelay> {
  return startChild(['bench/ws-relay.ts', upstream], 'ws relay')
}

/** A bare transaction pooler (bench/ws-pool-floor.ts) lending `size` backends: the floor for transaction pooling. */
export function startWsPoolFloor(connectionString: string, size: number): Promise<RunningRelay> {
  return startChild(['bench/ws-pool-floor.ts', connectionString, String(size)], 'ws pool floor')
}

/** A bare WebSocket server (bench/ws-echo.ts): the floor for a cold session. */
export function startWsEcho(): Promise<RunningRelay> {
  return startChild(['bench/ws-echo.ts'], 'ws echo')
}

/** A bare WebSocket server broadcasting each notification it is sent (bench/ws-broadcast.ts): the floor for fan-out. */
export function startWsBroadcast(): Promise<RunningRelay> {
  return startChild(['bench/ws-broadcast.ts'], 'ws broadcast')
}

/** A bare HTTP server (bench/http-floor.ts) answering every request with `body`: the floor for /sql. */
export function startHttpFloor(body: string): Promise<RunningRelay> {
  return startChild(['bench/http-floor.ts', body], 'http floor')
}

/** A bare HTTP server running each request's query on pg.Pool (bench/http-pg.ts): the floor for SQL over HTTP. */
export function startHttpPg(connectionString: string): Promise<RunningRelay> {
  return startChild(['bench/http-pg.ts', connectionString], 'http + pg.Pool')
}

/** Runs an entry point (TypeScript under tsx) and waits for its {"listening":"host:port"} line. */
async function startChild(args: string[], what: string): Promise<RunningRelay> {
  // (One process unless EDGEPG_WORKERS or --workers says otherwise: the sections compare one proxy process with its floor.)
  const child = spawn(process.execPath, [...(args[0].endsWith('.ts') ? ['--import', 'tsx'] : []), ...args], { cwd: root, stdio: ['pipe', 'pipe', 'pipe'], env: { EDGEPG_WORKERS: '1', ...process.env } })
  live.add(child)
  child.once('exit', () => live.delete(child))
  let stderr = ''
  child.stderr!.on('data', (d) => (stderr += d))
  const stop = () => stopChild(child)
  try {
    const port = await new Promise<number>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`${what} child did not report listening within 30 s`)), 30_000)
      child.once('error', reject)
      child.once('exit', (code) => reject(new Error(`${what} child exited (code ${code}) before listening: ${stderr.trim()}`)))
      // Keep reading stdout for the child's whole life (edgepg-proxy logs a line per session).
      createInterface({ input: child.stdout! }).on('line', (line) => {
        try {
          const msg = JSON.parse(line)
          if (msg.listening) {
            clearTimeout(timer)
            resolve(Number(String(msg.listening).split(':').pop()))
          }
        } catch {}
      })
    })
    return { port, cpuSeconds: () => cpuSecondsOf(child.pid!), stop }
  } catch (err) {
    await stop()
    throw err
  }
}
