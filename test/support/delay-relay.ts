import net from 'node:net'
import { backendReader, message } from './protocol'

/**
 * A TCP relay that holds every chunk, in each direction, for `oneWayMs` before passing it on, so
 * elapsed time divided by the RTT (2 × oneWayMs) counts network round trips. Order and
 * half-closes are delayed alike. Each chunk leaves within a few hundredths of a millisecond of
 * its time (a timer to just before it, then turns of the event loop): a timer alone is up to a
 * millisecond late, which the regions benchmark would count as the proxy's.
 */
export async function startDelayRelay(target: { host: string; port: number }, oneWayMs: number) {
  const sockets = new Set<net.Socket>()
  const pipe = (from: net.Socket, to: net.Socket) => {
    const due: Array<{ at: number; pass(): void }> = []
    const pump = () => {
      while (due.length && performance.now() >= due[0].at) due.shift()!.pass()
      if (!due.length) return
      const wait = due[0].at - performance.now()
      wait > 1.5 ? setTimeout(pump, wait - 1.5) : setImmediate(pump)
    }
    const later = (pass: () => void) => due.push({ at: performance.now() + oneWayMs, pass }) === 1 && pump()
    from.on('data', (chunk) => later(() => to.writable && to.write(chunk)))
    from.on('end', () => later(() => to.end()))
    from.on('error', () => later(() => to.destroy()))
    from.on('close', () => later(() => to.destroy()))
  }
  const server = net.createServer((client) => {
    client.setNoDelay(true)
    const upstream = net.connect({ ...target, noDelay: true })
    for (const s of [client, upstream]) sockets.add(s).size && s.once('close', () => sockets.delete(s))
    pipe(client, upstream)
    pipe(upstream, client)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as net.AddressInfo).port,
    rttMs: 2 * oneWayMs,
    /** Drops every connection under way, without a word to either side's application; new ones are relayed. */
    cut: () => {
      for (const s of sockets) s.destroy()
    },
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy()
        server.close(() => resolve())
      }),
  }
}

/** Whether Postgres's message is the row of the proxy's account of what a session left (proxy/isolation/verify.ts: `["<kinds>", <statements>, <settings>]`). */
export const isAccount = (type: string, body: Buffer) => type === 'D' && /^\["[a-z ]*", \d+, /.test(body.toString('latin1', 6))

/**
 * A TCP relay in front of Postgres that passes everything at once, but holds Postgres's messages
 * that `holds` gives a time to: each such one, and all after it on the connection, reach the client
 * that many ms later (in order, together), as if the network stalled just there.
 */
export async function startHoldingRelay(target: { host: string; port: number }, holds: (type: string, body: Buffer) => number) {
  const sockets = new Set<net.Socket>()
  const server = net.createServer((client) => {
    client.setNoDelay(true)
    const upstream = net.connect({ ...target, noDelay: true })
    for (const s of [client, upstream]) {
      sockets.add(s)
      s.once('close', () => sockets.delete(s)).on('error', () => {})
    }
    let held: Promise<void> | undefined
    // (What is passed in one turn of the event loop goes in one write, as a network delivers what piled up.)
    let corked = false
    const pass = (bytes: Buffer) => {
      if (!client.writable) return
      if (!corked) (corked = true), client.cork(), setImmediate(() => ((corked = false), client.uncork()))
      client.write(bytes)
    }
    const read = backendReader((type, body) => {
      const bytes = message(type, body)
      const ms = holds(type, body)
      if (ms) held = (held ?? Promise.resolve()).then(() => new Promise((resolve) => setTimeout(resolve, ms)))
      if (held) held = held.then(() => void pass(bytes))
      else pass(bytes)
    })
    client.pipe(upstream)
    upstream.on('data', read)
    for (const [a, b] of [[client, upstream], [upstream, client]]) a.on('close', () => (held ?? Promise.resolve()).then(() => b.destroy()))
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as net.AddressInfo).port,
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy()
        server.close(() => resolve())
      }),
  }
}
