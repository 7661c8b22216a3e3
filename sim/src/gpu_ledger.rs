//! What gpu-mps's manager has admitted on each GPU, and its admission rule: a container starts
//! only if its GPU has the memory left and a free MPS client. Strategies that place pods blind to
//! memory meet this rule after scheduling; the others must never trip it.

use crate::cluster::Shape;

/// Why the manager refuses a container at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ManagerRefusal {
    Memory,
    Clients,
}

#[derive(Debug, Clone)]
pub struct GpuLedger {
    free_gib: Vec<u32>,
    clients: Vec<u32>,
    max_clients: u32,
}

impl GpuLedger {
    pub fn new(shape: &Shape) -> Self {
        let gpus = shape.total_gpus() as usize;
        GpuLedger {
            free_gib: vec![shape.gib_per_gpu; gpus],
            clients: vec![0; gpus],
            max_clients: shape.max_clients_per_gpu,
        }
    }

    pub fn free_gib(&self, gpu: usize) -> u32 {
        self.free_gib[gpu]
    }

    pub fn has_client_slot(&self, gpu: usize) -> bool {
        self.clients[gpu] < self.max_clients
    }

    /// Admits one CUDA process of `gib` on `gpu`, or says why not (memory first, as the manager
    /// checks it).
    pub fn admit(&mut self, gpu: usize, gib: u32) -> Result<(), ManagerRefusal> {
        if self.free_gib[gpu] < gib {
            return Err(ManagerRefusal::Memory);
        }
        if !self.has_client_slot(gpu) {
            return Err(ManagerRefusal::Clients);
        }
        self.free_gib[gpu] -= gib;
        self.clients[gpu] += 1;
        Ok(())
    }

    pub fn release(&mut self, gpu: usize, gib: u32) {
        self.free_gib[gpu] += gib;
        self.clients[gpu] -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(gib: u32, clients: u32) -> Shape {
        Shape {
            nodes: 1,
            gpus_per_node: 1,
            gib_per_gpu: gib,
            max_clients_per_gpu: clients,
            min_units_per_process: 1,
        }
    }

    #[test]
    fn refuses_memory_then_clients_and_release_gives_back() {
        let mut l = GpuLedger::new(&shape(10, 2));
        assert_eq!(l.admit(0, 11), Err(ManagerRefusal::Memory));
        l.admit(0, 4).unwrap();
        l.admit(0, 4).unwrap();
        assert_eq!(l.admit(0, 2), Err(ManagerRefusal::Clients));
        assert_eq!(l.admit(0, 3), Err(ManagerRefusal::Memory));
        l.release(0, 4);
        assert_eq!(l.free_gib(0), 6);
        l.admit(0, 6).unwrap();
        assert_eq!(l.free_gib(0), 0);
    }
}
