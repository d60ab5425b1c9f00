/**
 * A pass-through TCP relay (no delay of its own) that counts each connection's round trips as the
 * client's turns to speak: the client's first bytes are turn 1, and each time it sends again after
 * the server has sent something, that is another turn. Put in front of a delay relay, this counts
 * the round trips a connect really waits for, independently of how long the client or the proxy
 * spends computing in between (which elapsed / RTT also includes).
 */
import net from 'node:net'

export interface TurnCounter {
  port: number
  /** Turns so far on the most recently accepted connection. */
  latestTurns(): number
  close(): Promise<void>
}

export async function startTurnCounter(target: { host: string; port: number }): Promise<TurnCounter> {
  const sockets = new Set<net.Socket>()
  let latest = { turns: 0 }
  const server = net.createServer({ noDelay: true }, (client) => {
    const conn = { turns: 0 }
    latest = conn
    let serverSpoke = true // so the client's first bytes open turn 1
    const upstream = net.connect({ ...target, noDelay: true })
    for (const s of [client, upstream]) {
      sockets.add(s)
      s.once('close', () => sockets.delete(s))
    }
    client.on('data', (chunk) => {
      if (serverSpoke) conn.turns++
      serverSpoke = false
      upstream.write(chunk)
    })
    upstream.on('data', (chunk) => {
      serverSpoke = true
      client.write(chunk)
    })
    client.on('end', () => upstream.end())
    upstream.on('end', () => client.end())
    client.on('error', () => upstream.destroy())
    upstream.on('error', () => client.destroy())
    client.on('close', () => upstream.destroy())
    upstream.on('close', () => client.destroy())
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as net.AddressInfo).port,
    latestTurns: () => latest.turns,
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy()
        server.close(() => resolve())
      }),
  }
}
